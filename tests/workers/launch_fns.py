"""Functions that tests run through ``accel_ctx.launch`` (importable, so spawn works too)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any


def whoami(tag: str) -> dict[str, Any]:
    """Join the job with distributed() and report what this rank saw."""
    import torch
    import torch.distributed as dist

    from accel_ctx import distributed, state

    with distributed():
        s = state()
        total = torch.tensor(float(s.rank + 1))
        dist.all_reduce(total)
        return {"tag": tag, "rank": s.rank, "world": s.world_size, "sum": float(total),
                "pid": os.getpid()}


def train_params(kind: str, batch_size: int) -> dict[str, Any]:
    from accel_ctx import distributed

    from .common import params, train

    with distributed():
        return params(train(kind, batch_size))


def fail_on(rank: int, message: str, wait: float = 60) -> None:
    """Rank ``rank`` raises ValueError(message); the others wait as if in a collective."""
    if int(os.environ["RANK"]) == rank:
        raise ValueError(message)
    time.sleep(wait)


def die_on(rank: int, wait: float = 60) -> None:
    """Rank ``rank`` is killed by SIGKILL; the others wait."""
    if int(os.environ["RANK"]) == rank:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(wait)


def sleep(seconds: float) -> None:
    time.sleep(seconds)


def exit_with(code: int) -> None:
    raise SystemExit(code)


def unpicklable_result() -> Any:
    return lambda: None


def die_leaving_a_child(rank: int, hold: float = 6, wait: float = 60) -> None:
    """Rank ``rank`` forks a helper (as a DataLoader does) that outlives it, then is killed."""
    if int(os.environ["RANK"]) == rank:
        if os.fork() == 0:  # the helper keeps every inherited descriptor open for ``hold`` s
            time.sleep(hold)
            os._exit(0)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(wait)


def device_of_rank() -> str:
    from accel_ctx import distributed, state

    with distributed():
        return str(state().device)


def fail_first_attempts(attempts: int, rank_failing: int) -> dict[str, Any]:
    """Fails on ``rank_failing`` while the restart count is below ``attempts``; the job's
    distributed() forms afresh on each attempt."""
    import torch

    from accel_ctx import distributed, reduce, state

    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    with distributed():
        if restart < attempts and state().rank == rank_failing:
            raise RuntimeError(f"flaky node on attempt {restart}")
        return {"restart": restart, "sum": float(reduce(torch.ones(1)))}
