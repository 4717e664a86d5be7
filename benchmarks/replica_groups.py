"""Fault-tolerant replica groups (issue 40): what they cost per step, and how long a fault stops
the survivors.

1. **Step time.** The same unchanged ``distributed()`` script (an MLP 256 -> 512 -> 512 -> 10
   with dropout, AdamW, a shuffled ``DataLoader``; 0.4 M parameters) at each per-rank batch of
   ``--batches`` (64: a step of a few ms, where any fixed cost shows; 2048: a step of ~50 ms on
   a quiet machine, the same parameters, so the same gradient all-reduce), launched
   as ``accel-ctx launch -n 1 --replica-groups 2`` (B: torchft's Manager, a quorum at the
   lighthouse every step, the gradients averaged across the groups by torchft's gloo group, a
   commit vote before ``opt.step()``) and as ``accel-ctx launch -n 2`` (A: plain DDP, gloo):
   world size 2 both. With ``--worlds 2,4`` also ``-n 2 --replica-groups 2`` against ``-n 4``.
   The script times its own committed steps (rank 0 of group 0): launch and start-up are out.
   A step's time is the interval between two consecutive commits (``state().step`` increments),
   after ``--warmup`` steps; a run gives the median interval (wall) and the mean process CPU
   time per step of that one process (all its threads: gloo's, torchft's; not the lighthouse's,
   the agents' or the other ranks'). Runs follow ``_measure.plan``: per round an A/B pair and an
   A/A pair (plain DDP twice), their orders alternating. The ratio B/A is the geometric mean of
   the rounds' ratios with its 95 % interval; the A/A ratio beside it is the noise floor. The
   exposed cost is B - A in ms per step, the median of the rounds' differences (A2 - A beside
   it, the floor). Targets (issue 53): exposed <= 1 ms at batch 64, ratio <= 1.03 at ~50 ms.
2. **Kill to next commit.** ``-n 1 --replica-groups 3 --max-restarts 0`` (``--kill-groups``):
   group 1's worker writes ``time.time()`` and SIGKILLs itself right after step ``--kill-at``
   committed. The survivors record the wall time of every committed step. Reported per round:
   the time from the kill to the survivors' first committed step after it (the later
   survivor's), which step that was and how many groups took it, and beside it the ordinary
   step time (median interval) of the survivors with all groups, before the kill, and without
   the dead one, after its first commit. The launcher exits non-zero (a group died and was not
   restarted): expected.

On this machine (2 cores) ``-n 4`` and ``-n 2 --replica-groups 2`` put 4 training processes
(plus gloo's and torchft's threads) on 2 cores: those rows measure contention as much as
communication. Nothing is asserted; the script prints tables and exits 0.

    python benchmarks/replica_groups.py                 # ~8-10 min on 2 quiet cores
    python benchmarks/replica_groups.py --quick         # smoke run, ~2 min; figures mean nothing
    python benchmarks/replica_groups.py --batches 64    # the tiny step only
    python benchmarks/replica_groups.py --worlds 2,4    # + -n 2 --replica-groups 2 vs -n 4
    python benchmarks/replica_groups.py --only kill     # one part: steps or kill
    python benchmarks/replica_groups.py --library OLD   # OLD/accel_ctx: another commit's

Run by the launcher with ``--worker OUT STEPS KILL_GROUP KILL_AT BATCH``, this file is the
script.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _measure import ACCEL, REF, REF2, Ratio, plan

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def worker(out: str, steps: int, kill_group: int, kill_at: int, batch: int = 64) -> None:
    """The training script: unchanged between the sides; rank 0 of each group writes its marks."""
    import signal

    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from accel_ctx import distributed, state

    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = max(64 * 4 * 16, batch * 16)  # at world 2: 8 steps an epoch at least
    data = TensorDataset(torch.randn(rows, 256), torch.randint(0, 10, (rows,)))
    with distributed():
        model = torch.nn.Sequential(
            torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Dropout(0.1),
            torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = DataLoader(data, batch_size=batch, shuffle=True)
        marks: list[tuple[int, int, float, float]] = []  # step, groups, time.time(), CPU
        last, done = -1, False
        s = state()
        while not done:
            for x, y in loader:
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                s = state()
                if s.step != last:  # committed (a failed step is not counted)
                    last = s.step
                    marks.append((s.step, s.replica_groups, time.time(), time.process_time()))
                if (s.replica_group, s.rank, s.step) == (kill_group, 0, kill_at):
                    Path(f"{out}.kill").write_text(repr(time.time()))
                    os.kill(os.getpid(), signal.SIGKILL)
                if s.step >= steps:
                    done = True
                    break
        if s.rank == 0:
            Path(f"{out}.g{max(s.replica_group, 0)}").write_text(json.dumps(marks))


class RunFailed(RuntimeError):
    pass


class Runner:
    def __init__(self, work: Path, library: Path = ROOT) -> None:
        self.work = work
        (work / ".git").mkdir()  # a project root: no config file from above is read
        self.env = {**os.environ, "PYTHONPATH": str(library), "OMP_NUM_THREADS": "1",
                    "XDG_CONFIG_HOME": str(work / "xdg"), "PYTHONWARNINGS": "ignore"}
        self.failures = 0

    def launch(self, args: list[str], steps: int, kill: tuple[int, int] = (-1, -1),
               ok_codes: tuple[int, ...] = (0,), batch: int = 64) -> str:
        """Run ``accel-ctx launch ARGS this-file --worker ...``; the output prefix."""
        while True:
            out = str(self.work / f"r{time.monotonic_ns()}")
            cmd = [str(BIN / "accel-ctx"), "launch", *args, __file__, "--worker", out,
                   str(steps), str(kill[0]), str(kill[1]), str(batch)]
            proc = subprocess.run(cmd, cwd=self.work, env=self.env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, timeout=300)
            if proc.returncode in ok_codes and Path(f"{out}.g0").exists():
                return out
            self.failures += 1  # reported, and the run measured again
            print(f"run failed ({' '.join(args)}, exit {proc.returncode}):\n"
                  f"{proc.stderr.decode(errors='replace')[-2500:]}", flush=True)
            if self.failures > 3:
                raise SystemExit("too many failed runs")


def marks_of(out: str, group: int = 0) -> list[tuple[int, int, float, float]]:
    return [tuple(m) for m in json.loads(Path(f"{out}.g{group}").read_text())]  # type: ignore[misc]


def step_figures(marks: list[tuple[int, int, float, float]], warmup: int) -> tuple[float, float]:
    """(median wall seconds between commits, mean CPU seconds per step) after the warm-up."""
    timed = marks[warmup:]
    walls = [b[2] - a[2] for a, b in itertools.pairwise(timed)]
    cpu = (timed[-1][3] - timed[0][3]) / (len(timed) - 1)
    return statistics.median(walls), cpu


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def step_time(runner: Runner, world: int, rounds: int, steps: int, warmup: int,
              warm: bool, batch: int) -> list[str]:
    per_group = world // 2
    sides = {REF: ["-n", str(world)], REF2: ["-n", str(world)],
             ACCEL: ["-n", str(per_group), "--replica-groups", "2"]}
    if warm:
        runner.launch(sides[ACCEL], warmup + 2, batch=batch)  # warm the file cache; not counted
    got: dict[tuple[str, str], dict[int, tuple[float, float]]] = {}
    for block in plan(rounds):
        figures = step_figures(marks_of(runner.launch(sides[block.side], steps, batch=batch)),
                               warmup)
        got.setdefault((block.kind, block.side), {})[block.pair] = figures
        print(f"  round {block.pair + 1} {block.kind} {block.side} (launch "
              f"{' '.join(sides[block.side])}, batch {batch}): {_ms(figures[0])} ms/step wall, "
              f"{_ms(figures[1])} ms CPU", flush=True)

    def ratio(kind: str, num: str, metric: int) -> Ratio:
        a, b = got[(kind, REF)], got[(kind, num)]
        return Ratio.of([b[i][metric] for i in sorted(a)], [a[i][metric] for i in sorted(a)])

    def exposed(kind: str, num: str) -> str:
        """Median over the rounds of B - A (wall ms per step), with its range."""
        a, b = got[(kind, REF)], got[(kind, num)]
        gaps = [b[i][0] - a[i][0] for i in sorted(a)]
        return f"{_ms(statistics.median(gaps))} [{_ms(min(gaps))} to {_ms(max(gaps))}]"

    ddp = [f for kind in ("AB", "AA") for f in got[(kind, REF)].values()]
    ft = list(got[("AB", ACCEL)].values())
    med = lambda xs, m: statistics.median(x[m] for x in xs)  # noqa: E731
    return [f"| -n {per_group} --replica-groups 2 vs -n {world} | {batch} | {_ms(med(ddp, 0))} | "
            f"{_ms(med(ft, 0))} | {exposed('AB', ACCEL)} | {exposed('AA', REF2)} | "
            f"{ratio('AB', ACCEL, 0)} | {ratio('AA', REF2, 0)} | "
            f"{_ms(med(ddp, 1))} | {_ms(med(ft, 1))} | {ratio('AB', ACCEL, 1)} | "
            f"{ratio('AA', REF2, 1)} | {rounds} |"]


def kill_to_commit(runner: Runner, groups: int, rounds: int, kill_at: int, after: int,
                   warmup: int) -> list[str]:
    rows, gaps, ordinary, without = [], [], [], []
    for i in range(rounds):
        out = runner.launch(["-n", "1", "--replica-groups", str(groups), "--max-restarts", "0"],
                            kill_at + after, kill=(1, kill_at), ok_codes=(0, 1, 137, -9))
        killed = float(Path(f"{out}.kill").read_text())
        firsts = []
        for g in (g for g in range(groups) if g != 1):
            marks = marks_of(out, g)
            # the survivors commit step kill_at too, maybe just after the kill: the next step
            first = next(m for m in marks if m[0] > kill_at and m[2] > killed)
            firsts.append(first)
        first = max(firsts, key=lambda m: m[2])
        marks = marks_of(out, 0)
        before = [m for m in marks if m[0] <= kill_at]
        later = [m for m in marks if m[0] >= first[0]]
        step = step_figures(before, min(warmup, len(before) - 3))[0]
        alone = step_figures(later, 0)[0]
        gap = first[2] - killed
        gaps.append(gap)
        ordinary.append(step)
        without.append(alone)
        rows.append(f"| {i + 1} | {kill_at} | {gap:.2f} | {first[0]} | {first[1]} | "
                    f"{_ms(step)} | {_ms(alone)} |")
        print(f"  kill round {i + 1}: killed after step {kill_at}, next commit (step "
              f"{first[0]}, {first[1]} groups) {gap:.2f} s later; step {_ms(step)} ms before, "
              f"{_ms(alone)} ms after", flush=True)
    rows.append(f"| median [range] | | {statistics.median(gaps):.2f} [{min(gaps):.2f}-"
                f"{max(gaps):.2f}] | | | {_ms(statistics.median(ordinary))} | "
                f"{_ms(statistics.median(without))} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run; figures mean nothing")
    parser.add_argument("--rounds", type=int, default=3, help="A/B + A/A pairs per world size")
    parser.add_argument("--steps", type=int, default=80, help="committed steps per run")
    parser.add_argument("--warmup", type=int, default=15, help="steps left out of the timing")
    parser.add_argument("--worlds", help="comma list of world sizes, even (default 2; 2,4)")
    parser.add_argument("--batches", default="64,2048",
                        help="comma list of per-rank batch sizes, a row each (default 64,2048: "
                        "a step of a few ms and one of ~50 ms on a quiet machine)")
    parser.add_argument("--kill-rounds", type=int, default=3)
    parser.add_argument("--kill-groups", type=int, default=3)
    parser.add_argument("--kill-at", type=int, default=30, help="group 1 dies after this step")
    parser.add_argument("--kill-after", type=int, default=15, help="steps the survivors go on")
    parser.add_argument("--only", choices=("steps", "kill"), help="run one of the two parts")
    parser.add_argument("--library", type=Path, default=ROOT,
                        help="the folder holding the accel_ctx package every run imports "
                        "(default: this checkout's; another commit's, to measure before/after)")
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        out, steps, kill_group, kill_at, batch = args.worker
        worker(out, int(steps), int(kill_group), int(kill_at), int(batch))
        return
    if args.quick:
        args.rounds, args.steps, args.warmup, args.kill_rounds = 1, 20, 5, 1
        args.kill_at, args.kill_after = 8, 6
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        runner = Runner(Path(tmp), args.library.resolve())
        step_rows: list[str] = []
        kill_rows: list[str] = []
        sizes = [(int(w), int(b)) for w in (args.worlds or "2").split(",")
                 for b in args.batches.split(",")] if args.only != "kill" else []
        for world, batch in sizes:
            print(f"step time, world size {world}, batch {batch} per rank:", flush=True)
            step_rows += step_time(runner, world, args.rounds, args.steps, args.warmup,
                                   warm=not args.quick, batch=batch)
        if args.only != "steps":
            print(f"kill to next commit, {args.kill_groups} groups:", flush=True)
            kill_rows = kill_to_commit(runner, args.kill_groups, args.kill_rounds, args.kill_at,
                                       args.kill_after, args.warmup)
    if step_rows:
        print(f"\nstep time, MLP 0.4 M parameters, AdamW, {args.steps} steps per run, the first "
              f"{args.warmup} left out; ms per committed step, medians over runs; exposed = "
              "groups - DDP, ms per step, median of the rounds' differences [range], A/A = "
              "DDP - DDP beside it (the floor); ratio = replica groups / plain DDP, geometric "
              "mean of the rounds' ratios [95 % CI], A/A = plain DDP / plain DDP (the floor); "
              "CPU = rank 0's process. Targets: exposed <= 1 ms at batch 64; ratio <= 1.03 at "
              "~50 ms steps")
        print("| replica groups vs plain DDP | batch per rank | DDP ms | groups ms | exposed ms | "
              "A/A ms | ratio wall | A/A wall | DDP CPU ms | groups CPU ms | ratio CPU | A/A CPU "
              "| rounds |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        print("\n".join(step_rows))
    if kill_rows:
        print(f"\nkill to next commit, -n 1 --replica-groups {args.kill_groups}, group 1 "
              f"SIGKILLed after step {args.kill_at} committed; seconds from the kill to the "
              "survivors' first committed step after it (the later survivor's)")
        print("| round | killed after step | kill to next commit s | that step | groups in it | "
              f"step ms, {args.kill_groups} groups | step ms, {args.kill_groups - 1} groups |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        print("\n".join(kill_rows))
    if runner.failures:
        print(f"{runner.failures} run(s) failed and were run again (see above)")
    print(f"\n{time.monotonic() - started:.0f} s in all; figures of a loaded machine are noise "
          f"(load average now {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
