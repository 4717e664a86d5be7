"""Failure scenarios run inside each spawned rank: each ends with an error on every rank, fast.

Every scenario opens its own distributed() scope (a fresh process group), so the ranks meet
again after the previous scenario's errors. Each returns (exception type, message, seconds).
Timeouts and waits are scaled (tests/_timeouts.py: a busy machine), the bounds the test checks
alike.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from accel_ctx import (
    distributed,
    gather,
    main_process_first,
    on_main_process,
    reduce,
    state,
    wait_for_everyone,
)

from .._timeouts import scaled


@on_main_process
def save_report() -> None:
    raise ValueError("disk full")


def _attempt(scenario: Callable[[], None]) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        scenario()
        outcome = ("ok", "")
    except Exception as exc:
        outcome = (type(exc).__name__, str(exc))
    return (*outcome, time.monotonic() - start)


def uncaught() -> None:
    with distributed():
        save_report()  # raises on rank 0 only; the others go on to the barrier
        wait_for_everyone()


def caught_and_continued() -> None:
    with distributed():
        with contextlib.suppress(ValueError):  # announced all the same: the job cannot go on
            save_report()
        wait_for_everyone()


def main_first_fails() -> None:
    with distributed(), main_process_first():
        if state().is_main_process:
            raise OSError("download failed")


def with_block_fails() -> None:
    with distributed():
        with on_main_process() as here:
            if here:
                raise RuntimeError("upload failed")
        wait_for_everyone()


def plain_if_fails() -> None:
    with distributed(timeout=scaled(30)):
        if state().is_main_process:
            raise ValueError("left the scope")  # any exception leaving distributed() is announced
        wait_for_everyone()


def silent_rank_times_out() -> None:
    with distributed(timeout=scaled(4)):
        if not state().is_main_process:
            wait_for_everyone()  # rank 0 never comes and never fails: the timeout names it
        else:
            time.sleep(scaled(6))


def collective_after_failure() -> None:
    with distributed(debug=True):
        save_report()
        gather(torch.ones(2))


def shapes_mismatch() -> None:
    with distributed(debug=True):
        gather({"logits": torch.zeros(2, 3 + state().rank)})


def calls_mismatch() -> None:
    with distributed(debug=True):
        if state().is_main_process:
            reduce(torch.ones(3))
        else:
            gather(torch.ones(3))


def barrier_vs_collective() -> None:
    os.environ["ACCEL_CTX_DEBUG"] = "1"  # the environment switch, this time
    try:
        with distributed():
            if state().is_main_process:
                wait_for_everyone()
            else:
                reduce(torch.ones(3), "max")
    finally:
        del os.environ["ACCEL_CTX_DEBUG"]


def debug_passes_when_shapes_fit() -> None:
    with distributed(debug=True):
        out = gather({"x": torch.ones(state().rank + 1, 2)})
        reduce(torch.ones(2, 2), "mean")
        wait_for_everyone()
        assert out["x"].shape[0] == sum(r + 1 for r in range(state().world_size))


SCENARIOS = {
    "uncaught": uncaught,
    "caught": caught_and_continued,
    "main_first": main_first_fails,
    "with_block": with_block_fails,
    "collective_after_failure": collective_after_failure,
    "shapes": shapes_mismatch,
    "calls": calls_mismatch,
    "barrier_vs_collective": barrier_vs_collective,
    "debug_ok": debug_passes_when_shapes_fit,
    "plain_if": plain_if_fails,
    "silent": silent_rank_times_out,  # last: the others wait out its 4 s timeout
}


def run_all() -> dict[str, Any]:
    return {name: _attempt(scenario) for name, scenario in SCENARIOS.items()}


def dead_peer() -> tuple[str, str, float]:
    """Rank 2's process dies without a word; the others wait for it at a sync point."""
    with distributed(timeout=scaled(60)):
        if state().rank == 2:
            time.sleep(scaled(1.5))  # its heartbeat has published where it is
            os._exit(3)
        return _attempt(wait_for_everyone)
