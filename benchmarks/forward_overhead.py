"""Forward-only overhead: a no_grad forward of a ~600-module model inside accel_ctx's scopes.

Evaluation and generation hide nothing: every submodule call goes through the patched
``nn.Module.__call__``. One process, one thread; each block opens the side's scopes (none for
the reference), runs warm-up forwards, then times ``n`` forwards under ``torch.no_grad()``.

================================  =================================  ===========================
row                               hand-written (A)                   accel_ctx (B)
================================  =================================  ===========================
fp32                              ``model(x)``, no scope             ``with distributed():``
bf16 distributed+mixed_precision  ``with torch.autocast(bf16):``     ``with distributed(),``
                                  ``model(x)`` then ``.float()``     ``mixed_precision("bf16")``
bf16 mixed_precision alone        the same                           ``with mixed_precision(..)``
================================  =================================  ===========================

The reference enters autocast around each forward and casts the output to fp32, which is what
``mixed_precision`` does for a top-level call without gradients (evaluation). Pairs
alternate (A B, B A, ...); the table gives the geometric mean of the per-pair ratios and the
A/A noise floor. Target: <= 1.05.

    python benchmarks/forward_overhead.py            # about a minute
    python benchmarks/forward_overhead.py --quick    # a few seconds
    python benchmarks/forward_overhead.py --profile  # + cProfile of the accel_ctx side
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import cProfile
import gc
import pstats
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack

import torch
from _measure import (
    ACCEL,
    Block,
    Sample,
    Timer,
    assert_stock,
    calibrate,
    plan,
    run_plan,
    table,
)
from _models import features_of, make_model
from torch import nn

from accel_ctx import distributed, mixed_precision

TARGET = 1.05
BATCH = 16

# row -> the scopes of the accel_ctx side (outermost first), and the reference's precision
ROWS: dict[str, tuple[tuple[Callable[[], AbstractContextManager[object]], ...], bool]] = {
    "fp32 distributed()": ((distributed,), False),
    "bf16 dist+mixed_prec": ((distributed, lambda: mixed_precision("bf16")), True),
    "bf16 mixed_prec alone": ((lambda: mixed_precision("bf16"),), True),
}


def forward_fn(model: nn.Module, x: torch.Tensor, by_hand_bf16: bool) -> Callable[[], object]:
    if not by_hand_bf16:
        return lambda: model(x)

    def forward() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        return out.float()

    return forward


def run_block(
    row: str, side: str, model: nn.Module, x: torch.Tensor, n: int, warmup: int,
    profiler: cProfile.Profile | None = None,
) -> Sample:
    scopes, bf16 = ROWS[row]
    accel = side == ACCEL
    forward = forward_fn(model, x, bf16 and not accel)
    if not accel:
        assert_stock()
    with ExitStack() as stack:
        if accel:
            for scope in scopes:
                stack.enter_context(scope())
        with torch.no_grad():
            for _ in range(warmup):
                forward()
            if profiler is not None:
                profiler.enable()
            with Timer() as timer:
                for _ in range(n):
                    forward()
            if profiler is not None:
                profiler.disable()
    return timer.sample(n)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 pairs, short blocks")
    parser.add_argument("--pairs", type=int, help="alternating pairs per row (default 10)")
    parser.add_argument("--block-seconds", type=float, help="one timed block (default 0.5)")
    parser.add_argument("--modules", type=int, default=600, help="model size (default 600)")
    parser.add_argument("--profile", action="store_true",
                        help="then cProfile one accel_ctx block per row and print the top")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    assert_stock()  # captures the stock entry points before any scope opens
    pairs = args.pairs or (2 if args.quick else 10)
    block_seconds = args.block_seconds or (0.1 if args.quick else 0.5)

    model = make_model(f"deep{args.modules}").eval()
    x = torch.randn(BATCH, features_of(model))
    modules = sum(1 for _ in model.modules())
    print(f"forward_overhead: no_grad forward of a {modules}-module model, batch {BATCH}, "
          f"{pairs} pairs per row, ~{block_seconds:g} s per timed block; torch "
          f"{torch.__version__}, 1 thread", flush=True)
    start = time.perf_counter()
    results = []
    for row in ROWS:
        # Warm-up pair, discarded; it also sizes the blocks.
        probe = run_block(row, "A", model, x, 20, 20)
        run_block(row, ACCEL, model, x, 20, 20)
        n = calibrate(probe.wall, block_seconds, 10 if args.quick else 20, 100_000)
        gc.collect()
        gc.freeze()

        def one(block: Block, row: str = row, n: int = n) -> Sample:
            return run_block(row, block.side, model, x, n, max(5, n // 20))

        results.append(run_plan(plan(pairs), one, row))
        print(f"  {row}: {n} forwards per block", file=sys.stderr, flush=True)
    print(table(results, "forward", TARGET))
    print(f"({time.perf_counter() - start:.0f} s)")
    if args.profile:
        for row in ROWS:
            profiler = cProfile.Profile()
            run_block(row, ACCEL, model, x, 300, 20, profiler)
            print(f"\ncProfile, accel_ctx side of {row!r}, 300 forwards, by internal time:")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(12)
    return 0


if __name__ == "__main__":
    sys.exit(main())
