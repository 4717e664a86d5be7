"""Launch-to-first-step time: `accel-ctx launch -n 2` (A) against plain torchrun (B).

Both start the same script, which joins the job with ``distributed()`` and takes one training
step; the time is from starting the command to the last rank finishing that step. Runs are
interleaved in one session, in alternating order (A B, B A, ...), and the geometric mean of
the per-pair ratios A/B is reported beside the A/A ratio (the same command twice in a row),
which is the noise floor: a ratio inside it is no measurable difference. CPU time (launcher
and workers together) is reported beside wall time. Target: A/B <= 1.05.

    python benchmarks/launch_overhead.py [--pairs 8] [--aa-pairs 4] [--nproc 2]

Run by the launcher with ``--worker OUT``, this file is the script being launched.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def worker(out: str) -> None:
    import torch

    from accel_ctx import distributed, state

    with distributed():
        model = torch.nn.Linear(16, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(8, 16)).sum().backward()  # DDP all-reduces the gradients
        opt.step()
        rank = state().rank
    Path(f"{out}.{rank}").write_text(repr(time.time()))


class RunFailed(RuntimeError):
    pass


def run_once(command: list[str], nproc: int, work: Path, env: dict[str, str]) -> tuple[float, float]:
    """(seconds to the last rank's first step, CPU seconds of everything started)."""
    out = work / f"t{time.monotonic_ns()}"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.time()
    proc = subprocess.run([*command, __file__, "--worker", str(out)], cwd=work, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=300)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RunFailed(f"{Path(command[0]).name} failed:\n{proc.stderr.decode()[-3000:]}")
    first_step = max(float(Path(f"{out}.{r}").read_text()) for r in range(nproc)) - start
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return first_step, cpu


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=8, help="A/B pairs (order alternates)")
    parser.add_argument("--aa-pairs", type=int, default=4, help="A/A pairs: the noise floor")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    n = str(args.nproc)
    a = [str(BIN / "accel-ctx"), "launch", "-n", n]
    b = [str(BIN / "torchrun"), "--nproc-per-node", n]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / ".git").mkdir()  # a project root: no config file from above is read
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
               "XDG_CONFIG_HOME": str(work / "xdg")}
        ab: list[float] = []
        ab_cpu: list[float] = []
        aa: list[float] = []
        aa_cpu: list[float] = []
        times: dict[str, list[float]] = {"A": [], "B": []}
        failures = 0

        def pair(first: list[str], second: list[str]) -> tuple[tuple[float, float], ...]:
            nonlocal failures
            while True:  # a crashed run is reported and its pair measured again
                try:
                    return tuple(run_once(c, args.nproc, work, env) for c in (first, second))
                except RunFailed as exc:
                    failures += 1
                    print(exc, flush=True)
                    if failures > 3:
                        raise SystemExit("too many failed runs") from exc

        pair(a, b)  # warm the file cache for both sides; not counted
        for i in range(args.pairs):
            order = ("A", "B") if i % 2 == 0 else ("B", "A")
            got = dict(zip(order, pair(*(a if s == "A" else b for s in order)), strict=True))
            ab.append(got["A"][0] / got["B"][0])
            ab_cpu.append(got["A"][1] / got["B"][1])
            for side in order:
                times[side].append(got[side][0])
            print(f"pair {i + 1} ({order[0]} then {order[1]}): A {got['A'][0]:.2f} s, "
                  f"B {got['B'][0]:.2f} s, A/B {ab[-1]:.3f}", flush=True)
        for i in range(args.aa_pairs):
            first, second = pair(a, a)
            aa.append(second[0] / first[0])
            aa_cpu.append(second[1] / first[1])
            print(f"A/A pair {i + 1}: {first[0]:.2f} s, {second[0]:.2f} s, "
                  f"ratio {aa[-1]:.3f}", flush=True)
    spread = max(abs(math.log(r)) for r in aa) if aa else float("nan")
    print()
    print(f"launch-to-first-step, {args.nproc} processes, {args.pairs} interleaved pairs")
    print(f"  accel-ctx launch (A): median {sorted(times['A'])[len(times['A']) // 2]:.2f} s")
    print(f"  torchrun         (B): median {sorted(times['B'])[len(times['B']) // 2]:.2f} s")
    print(f"  A/B wall: {geomean(ab):.3f} (geometric mean of pair ratios; target <= 1.05)")
    print(f"  A/B CPU:  {geomean(ab_cpu):.3f}")
    if aa:
        print(f"  A/A noise floor: {geomean(aa):.3f} wall, {geomean(aa_cpu):.3f} CPU "
              f"(largest single A/A pair off by {math.exp(spread) - 1:.1%})")
    if failures:
        print(f"  {failures} run(s) crashed and were measured again (see above)")


if __name__ == "__main__":
    main()
