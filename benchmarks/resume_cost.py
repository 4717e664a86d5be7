"""What ``resumable()`` costs a training loop: its per-step agreement and its periodic saves.

One process, CPU, an MLP of ``--width`` (default 1024: about 3 M parameters, 12 MB with AdamW's
state). Sides, per step of the same loop (A = reference, B = accel_ctx):

* ``scope``: ``distributed()`` alone (A) vs ``distributed(), resumable(every_steps=None)`` (B):
  the bookkeeping at each step boundary, no save;
* ``saves``: ``distributed()`` (A) vs ``resumable(every_steps=K)`` (B): periodic saves, one
  every K steps, staged at the step boundary and written by a background thread;
* ``sync``: the same with each save waited for (as a synchronous save costs): one save's
  synchronous share of the interval;
* ``A/A``: ``distributed()`` twice, the noise floor.

Sides alternate within each pair (A B, B A, ...) and each ratio is the geometric mean of the
pairs' ratios (see ``_measure``). The issue's target: periodic saves ≤ 5 % of step time where
one save's synchronous cost is ≥ 10 % of the interval.

    python benchmarks/resume_cost.py                 # 6 pairs, about a minute
    python benchmarks/resume_cost.py --pairs 2 --steps 40
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from accel_ctx import distributed, resumable


def _loop(steps: int, width: int, folder: Path | None, every: int | None,
          sync: bool = False) -> float:
    """Seconds per step of the plain loop, in ``distributed()`` (+ ``resumable()``);
    ``sync``: each save is waited for."""
    from accel_ctx._checkpoint import saver

    real = saver.Saver.save
    if sync:
        def waited(self: saver.Saver, *args: object, **kwargs: object) -> object:
            real(self, *args, **kwargs)  # type: ignore[arg-type]
            return self.wait()

        saver.Saver.save = waited  # type: ignore[method-assign,assignment]
    torch.manual_seed(0)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
    with distributed():
        scope = resumable(folder, every_steps=every) if folder is not None else None
        if scope is not None:
            scope.__enter__()
        try:
            model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width),
                                  nn.ReLU(), nn.Linear(width, 10))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            x = torch.randn(64, width)
            for _ in range(3):  # warm up
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            start = time.perf_counter()
            for _ in range(steps):
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            if scope is not None:  # the save in flight counts: wait for it
                scope._runtime().saver.wait()
            return (time.perf_counter() - start) / steps
        finally:
            saver.Saver.save = real  # type: ignore[method-assign]
            if scope is not None:
                scope.__exit__(None, None, None)


def _ratio(pairs: list[tuple[float, float]]) -> str:
    logs = [math.log(b / a) for a, b in pairs]
    mean = statistics.fmean(logs)
    spread = statistics.stdev(logs) if len(logs) > 1 else 0.0
    return f"{math.exp(mean):.3f} (±{spread:.3f} log-sd)"


def main() -> None:
    # One thread for the loop, as every benchmark here: the second core is the background
    # writer's, as the host's cores are beside a GPU's training.
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--every", type=int, default=20)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp()) / "run"
    rows: dict[str, list[tuple[float, float]]] = {"A/A": [], "scope": [], "saves": [],
                                                  "sync": []}
    sides = {
        "A/A": lambda: _loop(args.steps, args.width, None, None),
        "scope": lambda: _loop(args.steps, args.width, folder, None),
        "saves": lambda: _loop(args.steps, args.width, folder, args.every),
        "sync": lambda: _loop(args.steps, args.width, folder, args.every, sync=True),
    }
    for i in range(args.pairs):
        for name, side in sides.items():
            if i % 2 == 0:
                a = _loop(args.steps, args.width, None, None)
                b = side()
            else:
                b = side()
                a = _loop(args.steps, args.width, None, None)
            rows[name].append((a, b))
    step = statistics.median(a for pairs in rows.values() for a, _ in pairs)
    # one save's synchronous cost: the extra time of the "sync" side, per save
    extra = statistics.median(b - a for a, b in rows["sync"]) * args.steps
    saves = args.steps // args.every
    print(f"step (A, median): {step * 1e3:.2f} ms; one save ≈ {extra / max(saves, 1) * 1e3:.1f} ms "
          f"= {extra / max(saves, 1) / (args.every * step):.0%} of the {args.every}-step interval")
    for name, pairs in rows.items():
        print(f"{name:>6}: B/A = {_ratio(pairs)}")
    shutil.rmtree(folder.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
