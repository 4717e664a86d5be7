"""Waits that must end in time, naming the rank and the cause (issue #23, points 8, 9, 14).

Each function runs inside every spawned rank and reports what the rank saw: the error it
raised (type and message), how long it took, and the progress lines it logged meanwhile.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from accel_ctx import (
    broadcast,
    broadcast_object,
    distributed,
    find_executable_batch_size,
    gather,
    gather_object,
    reduce,
    sharded,
    state,
    wait_for_everyone,
)

from .._timeouts import scaled
from .rendezvous_trust import _Lines


@contextmanager
def _progress_lines() -> Iterator[list[str]]:
    handler = _Lines()
    logger = logging.getLogger("accel_ctx")
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)


def _outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    start = time.monotonic()
    with _progress_lines() as lines:
        try:
            value: Any = fn()
            out: dict[str, Any] = {"value": value}
        except Exception as exc:  # the test looks at the type, the message and the time
            out = {"error": type(exc).__name__, "message": str(exc)}
    return {**out, "seconds": time.monotonic() - start, "lines": list(lines)}


# --- 8c: ranks in different collectives -----------------------------------------------------------
def different_calls() -> dict[str, Any]:
    """Each case: the last rank calls another collective than the others; then a good call."""
    out: dict[str, Any] = {}
    with distributed(timeout=scaled(40)):
        rank, world = state().rank, state().world_size
        odd = rank == world - 1
        cases: dict[str, Callable[[], Any]] = {
            "reduce_vs_gather": lambda: gather(torch.ones(3)) if odd else reduce(torch.ones(3)),
            "gather_vs_gather_object": lambda: (gather_object({"r": rank}) if odd
                                                else gather(torch.ones(3))),
            "broadcast_vs_reduce": lambda: (reduce(torch.ones(2), "max") if odd
                                            else broadcast(torch.ones(2))),
            "gather_object_vs_broadcast_object": lambda: (
                broadcast_object([rank]) if odd else gather_object([rank])),
            "any_rank_vs_gather": lambda: gather([rank]) if odd else reduce(rank > 0, "max"),
        }
        for name, fn in cases.items():
            out[name] = _outcome(fn)
            out[name + "/after"] = _outcome(lambda: gather(torch.tensor([rank])).tolist())
        out["gather_object"] = _outcome(lambda: gather_object({"r": rank}))
        out["reduce_exact"] = _outcome(lambda: reduce({"x": 0.1 * (rank + 1), "n": rank + 1,
                                                       "big": torch.tensor([2**60 + rank])}))
    return out


# --- 8d: a sharded model's forward on rank 0 alone, the others at a barrier ----------------------
def sharded_forward_on_rank_zero(timeout: float) -> dict[str, Any]:
    def run() -> None:
        with distributed(timeout=timeout), sharded():
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(2):
                model(torch.randn(4, 8)).sum().backward()
                opt.step()
                opt.zero_grad()
            if state().rank == 0:  # not @on_main_process: nothing refuses it up front
                with torch.no_grad():
                    model(torch.randn(4, 8))
            wait_for_everyone()

    return _outcome(run)


# --- 8: progress lines while a rank waits for one doing rank-only work ---------------------------
def waits_with_progress_lines(seconds: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, call in (("barrier", wait_for_everyone),
                       ("collective", lambda: reduce(torch.ones(1)))):
        def run(call: Callable[[], Any] = call) -> None:
            with distributed(timeout=scaled(60)):
                if state().rank == 0:
                    time.sleep(seconds)  # a long evaluation on rank 0 alone
                call()

        out[name] = _outcome(run)

    def backward() -> None:  # rank 1 waits in DDP's gradient all-reduce, inside autograd
        with distributed(timeout=scaled(60)):
            model = torch.nn.Linear(4, 4)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for i in range(3):
                if state().rank == 0 and i == 2:
                    time.sleep(seconds)
                # each rank its own batch: the same batch on every rank would be compared at
                # the next step's forward (the same-inputs check), where rank 1 would wait then
                model(torch.randn(8, 4) + state().rank).sum().backward()
                opt.step()
                opt.zero_grad()

    out["backward"] = _outcome(backward)
    return out


# --- 8e: find_executable_batch_size, one rank out of memory before its forward -------------------
def _until_rank_one_runs_out_of_memory(**options: Any) -> int:
    """find_executable_batch_size in distributed(**options); rank 1 runs out of memory at
    batch size 8, before its forward."""
    with distributed(**options):
        @find_executable_batch_size(starting_batch_size=8)
        def train(batch_size: int) -> int:
            model = torch.nn.Linear(4, 4)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            if state().rank == 1 and batch_size > 4:  # before it reaches the forward
                raise torch.OutOfMemoryError("CUDA out of memory (pretend)")
            for _ in range(2):
                model(torch.randn(batch_size, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
            return batch_size

        return train()


def out_of_memory_before_forward(timeout: float) -> dict[str, Any]:
    return _outcome(functools.partial(_until_rank_one_runs_out_of_memory, timeout=timeout))


# --- 9: a rank that leaves early is named where it really was ------------------------------------
def leave_at_step_five(how: str) -> dict[str, Any]:
    """Rank 1 ends its process at step 5; its heartbeat is starved (as on a busy machine): it
    publishes once, as the scope begins, and never again."""
    from accel_ctx._job import progress as _progress

    if int(os.environ["RANK"]) == 1:
        _progress.INTERVAL_S = 3600.0

    def run() -> None:
        with distributed(timeout=scaled(60)):
            torch.manual_seed(0)
            model = torch.nn.Linear(4, 4)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(20):
                if state().rank == 1 and state().step == 5:
                    if how == "kill":
                        os.kill(os.getpid(), 9)
                    os._exit(0)
                model(torch.randn(8, 4)).sum().backward()
                opt.step()
                opt.zero_grad()

    return _outcome(run)


# --- #38, point 6: the waits the issue saw silent or stuck, with distributed()'s defaults --------
def _culprit(fn: Callable[[], Any]) -> dict[str, Any]:
    """:func:`_outcome`, with the rank the error names for the launcher (its ``culprit``)."""
    culprit: list[Any] = [None]

    def run() -> Any:
        try:
            return fn()
        except Exception as exc:
            culprit[0] = getattr(exc, "culprit", None)
            raise

    return {**_outcome(run), "culprit": culprit[0]}


def different_calls_then_out_of_memory() -> dict[str, Any]:
    """Rank 0 in reduce(), the others in gather() at step 3 of a training loop, then a good
    gather; then, in a new scope, find_executable_batch_size with rank 1 out of memory before
    its forward. Every timeout is distributed()'s default (600 s)."""
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    with distributed():
        rank = state().rank
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.1),
                                    torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(5):
            loss = model(torch.randn(8, 4) + rank).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step == 2:
                out["calls"] = _culprit(functools.partial(reduce if rank == 0 else gather,
                                                          loss.detach().reshape(1)))
                out["after"] = _outcome(lambda: gather(torch.tensor([rank])).tolist())
        out["step"] = state().step

    out["oom"] = _culprit(_until_rank_one_runs_out_of_memory)
    return out


def sharded_forward_on_rank_zero_by_default() -> dict[str, Any]:
    """:func:`sharded_forward_on_rank_zero` with distributed()'s default timeout."""
    def run() -> None:
        torch.manual_seed(0)
        with distributed(), sharded():
            model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(2):
                model(torch.randn(4, 8)).sum().backward()
                opt.step()
                opt.zero_grad()
            if state().rank == 0:
                with torch.no_grad():
                    model(torch.randn(4, 8))
            wait_for_everyone()

    return _culprit(run)


def exit_mid_training() -> dict[str, Any]:
    """Rank 1 leaves with os._exit(0) at step 5 of 20, its heartbeat running as usual."""
    def run() -> None:
        torch.manual_seed(0)
        with distributed():
            model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.1),
                                        torch.nn.Linear(8, 1))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(20):
                if state().rank == 1 and state().step == 5:
                    os._exit(0)
                model(torch.randn(8, 4) + state().rank).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()

    return _culprit(run)
