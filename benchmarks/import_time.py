"""The cost of importing accel_ctx's scopes on top of ``import torch``, in fresh interpreters.

``from accel_ctx import distributed, mixed_precision, accumulate`` is timed: the package itself
loads each public name at its first use, so a bare ``import accel_ctx`` costs next to nothing.

Two measures, both from fresh ``python`` processes:

1. Whole interpreters, timed from outside: ``python -c "import torch"`` (A) against
   ``python -c "import torch; from accel_ctx import ..."`` (B), in alternating pairs (A B, B A, ...),
   with A/A pairs (A twice) for the noise floor. Reported: the median and mean of the per-pair
   differences B - A in ms (wall and CPU of the child), the geometric mean of the ratios B / A,
   and the same for A/A. Start-up of ``import torch`` varies by tens of ms here, so this one
   needs many pairs to resolve 30 ms.
2. ``python -X importtime -c "import torch; from accel_ctx import ..."``: the interpreter's
   own clock for the ``accel_ctx`` imports after torch is loaded ("cumulative"), median over
   the runs, and the modules it pulls in that take longest. This one is precise, but counts
   only the import itself (not the interpreter's start or exit).

Target: <= 30 ms.

    python benchmarks/import_time.py            # 12 pairs, about 2 minutes
    python benchmarks/import_time.py --quick    # 3 pairs
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from _measure import ACCEL, REF, Comparison, Sample, plan

TARGET_MS = 30.0
ROOT = Path(__file__).resolve().parent.parent
# The scopes' names, not the bare package: `import accel_ctx` loads each public name at its
# first use, so it alone would time next to nothing.
CODE = {REF: "import torch",
        ACCEL: "import torch; from accel_ctx import distributed, mixed_precision, accumulate"}
_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")


def child_env(bytecode_cache: bool) -> dict[str, str]:
    """The children's environment: one thread; byte code cached like a normal install.

    This workplace sets PYTHONDONTWRITEBYTECODE, so accel_ctx (installed editable) would be
    compiled from source in every fresh interpreter. By default the children write and read
    byte code under a cache folder of their own (PYTHONPYCACHEPREFIX, for torch too, so both
    sides read it the same way); ``--no-bytecode-cache`` measures the uncached import.
    """
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPROFILEIMPORTTIME", None)
    env.pop("PYTHONPYCACHEPREFIX", None)
    if bytecode_cache:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(Path(tempfile.gettempdir()) / "accel-ctx-bench-pycache")
    else:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def run_python(args: list[str], env: dict[str, str]) -> tuple[Sample, str]:
    """Wall and CPU seconds of one fresh interpreter (and what it wrote to stderr)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"import_time: python {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Sample(wall, cpu), proc.stderr


def importtime(stderr: str) -> tuple[float, dict[str, float]]:
    """Cumulative µs of the top-level ``accel_ctx`` imports (the package, then the modules its
    names load on first use), and self µs of what they imported."""
    lines = [m.groups() for m in map(_LINE.match, stderr.splitlines()) if m]
    total, pulled, start = 0.0, {}, -1
    for i, (_, cumulative, indent, name) in enumerate(lines):
        if len(indent) != 1:
            continue
        if name == "accel_ctx" or name.startswith("accel_ctx."):
            # Lines come in completion order: a top-level import's own imports are those
            # printed since the previous top-level line.
            total += float(cumulative)
            pulled.update({n: float(s) for s, _, _, n in lines[start + 1 : i]})
        start = i
    if not total:
        raise SystemExit("import_time: no accel_ctx line in the -X importtime output")
    return total, pulled


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 3 pairs")
    parser.add_argument("--pairs", type=int, help="alternating pairs (default 12; quick 3)")
    parser.add_argument("--no-bytecode-cache", action="store_true",
                        help="compile accel_ctx from source in every run, as this workplace's "
                        "PYTHONDONTWRITEBYTECODE=1 does")
    args = parser.parse_args(argv)
    pairs = args.pairs or (3 if args.quick else 12)
    env = child_env(not args.no_bytecode_cache)
    cache = "no byte-code cache" if args.no_bytecode_cache else "byte code cached"
    print(f"import_time: {pairs} pairs of fresh interpreters ({sys.executable}, {cache}), then "
          "-X importtime runs; target <= 30 ms", flush=True)

    for _ in range(2):  # fill the byte-code cache and warm the page cache; discarded
        run_python(["-c", CODE[ACCEL]], env)
    result = Comparison("import accel_ctx")
    totals: list[float] = []
    parts: dict[str, list[float]] = defaultdict(list)
    for i, block in enumerate(plan(pairs)):
        sample, _ = run_python(["-c", CODE[ACCEL if block.side == ACCEL else REF]], env)
        result.add(block, sample)
        if i % 4 == 3:  # after the four runs of each pair (A/B and A/A): one -X importtime run
            _, stderr = run_python(["-X", "importtime", "-c", CODE[ACCEL]], env)
            total, own = importtime(stderr)
            totals.append(total / 1e3)
            for name, us in own.items():
                parts[name].append(us / 1e3)

    def diffs(kind: str, second: str, metric: str) -> list[float]:
        a = result.samples[(kind, REF)]
        b = result.samples[(kind, second)]
        return [(getattr(b[i], metric) - getattr(a[i], metric)) * 1e3 for i in sorted(a)]

    print(f"\n1. fresh interpreters, B - A per pair in ms (median, mean; {pairs} pairs)")
    print(f"   {'':<26} {'wall median':>11} {'wall mean':>10} {'cpu median':>11} "
          f"{'cpu mean':>9}  {'ratio wall':<22} {'ratio cpu':<22}")
    for label, kind, second in (("import accel_ctx (B - A)", "AB", ACCEL),
                                ("A/A noise floor (A2 - A)", "AA", "A2")):
        wall, cpu = diffs(kind, second, "wall"), diffs(kind, second, "cpu")
        print(f"   {label:<26} {statistics.median(wall):>11.1f} {statistics.fmean(wall):>10.1f} "
              f"{statistics.median(cpu):>11.1f} {statistics.fmean(cpu):>9.1f}  "
              f"{result.ratio('wall', kind)!s:<22} {result.ratio('cpu', kind)!s:<22}")
    print(f"   interpreter with import torch alone: {result.median(REF, 'wall') * 1e3:.0f} ms wall, "
          f"{result.median(REF, 'cpu') * 1e3:.0f} ms cpu (median)")

    median = statistics.median(totals)
    print(f"\n2. -X importtime, cumulative time of `import accel_ctx` after torch ({len(totals)} "
          f"runs): median {median:.1f} ms, min {min(totals):.1f}, max {max(totals):.1f}")
    print("   slowest modules it imports (self time, median ms):")
    ranked = sorted(parts.items(), key=lambda kv: -statistics.median(kv[1]))
    for name, values in ranked[:10]:
        print(f"     {statistics.median(values):6.2f}  {name}")
    verdict = "ok" if median <= TARGET_MS else "OVER"
    if median > TARGET_MS >= min(totals):
        verdict = "over? (noisy: the fastest run is within the budget)"
    print(f"\n   verdict (-X importtime median vs {TARGET_MS:.0f} ms): {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
