"""Scenarios run in each spawned rank: a stalled, departed or rank-only rank is named at once.

Each scenario opens its own distributed() scope (a fresh process group) and returns
(exception type, message, culprit attribute, seconds). ``FLAG`` files in the shared folder
let a stalled rank wait exactly until the others have given up on it, so no test depends on a
sleep being long enough.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from accel_ctx import (
    distributed,
    gather,
    load_state,
    main_process_first,
    on_local_main_process,
    on_main_process,
    on_process,
    reduce,
    save_model,
    save_state,
    state,
    wait_for_everyone,
)

from .._timeouts import scaled

# seconds, scaled where used (tests/_timeouts.py: a busy machine), the test's bounds alike
STALL_TIMEOUT = 10.0  # distributed(timeout=...) where a rank stalls: the gloo timeout that applies
LONG = 120.0  # where the others must raise at once: far longer than any test waits


def _attempt(scenario: Callable[[], None]) -> tuple[str, str, Any, float]:
    start = time.monotonic()
    try:
        scenario()
        outcome: tuple[str, str, Any] = ("ok", "", None)
    except Exception as exc:
        outcome = (type(exc).__name__, str(exc), getattr(exc, "culprit", None))
    return (*outcome, time.monotonic() - start)


def _wait_for_flag(path: Path, limit: float = 90.0) -> None:
    deadline = time.monotonic() + scaled(limit)
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.2)


class Sleepy(nn.Module):
    """A model whose forward stalls on one rank at one step, until told to go on."""

    def __init__(self, flag: Path, rank: int, step: int) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.flag, self.rank, self.step = flag, rank, step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if state().rank == self.rank and state().step == self.step:
            _wait_for_flag(self.flag)  # stalled "in forward" until the others gave up
        return self.lin(x)


def _train(model: nn.Module, steps: int, stop: Callable[[int], bool] = lambda s: False) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        if stop(step):
            return
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
        opt.zero_grad()


def stall_in_forward(folder: Path) -> Callable[[], None]:
    """Rank 1 stalls inside its forward at step 3: the others time out and name it."""
    flag = folder / "stall-gave-up"

    def scenario() -> None:
        try:
            with distributed(timeout=scaled(STALL_TIMEOUT)):
                torch.manual_seed(0)
                _train(Sleepy(flag, 1, 3), 6)
        finally:
            if state().rank != 1:
                flag.touch()  # the stalled rank may go on now

    return scenario


def stall_in_save(folder: Path) -> Callable[[], None]:
    """Rank 1 stalls inside save_state(), writing its file (a write that hangs): it stands at
    the same step and call as the others, which time out waiting and name it."""
    from accel_ctx._checkpoint import files

    flag = folder / "save-gave-up"

    def scenario() -> None:
        stock = files.save_torch

        def hanging(*args: Any, **kwargs: Any) -> Any:
            if state().rank == 1:
                _wait_for_flag(flag)
            return stock(*args, **kwargs)

        files.save_torch = hanging
        try:
            with distributed(timeout=scaled(STALL_TIMEOUT)):
                torch.manual_seed(0)
                model = nn.Linear(4, 2)
                _train(model, 2)
                save_state(folder / "ckpt", model=model)
        finally:
            files.save_torch = stock
            if state().rank != 1:
                flag.touch()

    return scenario


def leave_then_backward() -> None:
    """Rank 1 returns from its loop at step 3 and leaves distributed(); rank 0's next
    backward raises at once naming it."""
    with distributed(timeout=scaled(LONG)):
        torch.manual_seed(0)
        _train(nn.Linear(4, 2), 6, stop=lambda s: state().rank == 1 and s == 3)


def leave_then_barrier() -> None:
    """Rank 1 leaves after two steps; rank 0 waits in wait_for_everyone(): raises at once."""
    with distributed(timeout=scaled(LONG)):
        torch.manual_seed(0)
        _train(nn.Linear(4, 2), 2)
        if state().rank != 1:
            wait_for_everyone()


def leave_then_debug_check() -> None:
    """Rank 1 leaves; rank 0's debug-mode gather() raises at once naming it."""
    with distributed(timeout=scaled(LONG), debug=True):
        if state().rank != 1:
            time.sleep(scaled(0.5))
            gather(torch.ones(2))


def rank_only_calls(folder: Path, out: dict[str, tuple[str, str, Any, float]]) -> None:
    """Collective entry points inside rank-only code raise at once, naming the decorator."""
    with distributed(timeout=scaled(LONG)):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def in_main(name: str, fn: Callable[[], Any]) -> None:
            decorated = on_main_process(fn)
            result = _attempt(lambda: decorated())
            if state().is_main_process:
                out[name] = result

        in_main("gather", lambda: gather(torch.ones(2)))
        in_main("reduce", lambda: reduce(torch.ones(2)))
        in_main("wait_for_everyone", wait_for_everyone)
        in_main("save_state", lambda: save_state(folder / "ckpt", model=model))
        in_main("load_state", lambda: load_state(folder / "ckpt", model=model))
        in_main("save_model", lambda: save_model(model, folder / "model.pt"))
        in_main("train_step", lambda: model(torch.randn(8, 4)).sum().backward())
        # allowed: a forward without gradients, and one with gradients but no backward
        in_main("preview", lambda: model(torch.randn(2, 4)).shape[0])
        with torch.no_grad():
            in_main("eval", lambda: model(torch.randn(2, 4)).shape[0])
        loss = model(torch.randn(8, 4)).sum()  # every rank: through DDP
        in_main("backward", loss.backward)
        loss.backward()  # every rank: the real one, averaged, then a step
        opt.step()
        local = on_local_main_process(lambda: gather(torch.ones(1)))
        rank1 = on_process(1)(lambda: reduce(torch.ones(1)))
        out["local"] = _attempt(local) if state().local_rank == 0 else ("skipped", "", None, 0)
        out["rank1"] = _attempt(rank1) if state().rank == 1 else ("skipped", "", None, 0)
        wait_for_everyone()  # the failures above were announced: every rank stops here


def main_first_collective() -> None:
    """A collective inside main_process_first() on rank 0: refused, and the waiting ranks
    are released naming rank 0."""
    with distributed(timeout=scaled(LONG)), main_process_first():
        gather(torch.ones(1))


def run_all(folder: str) -> dict[str, Any]:
    root = Path(folder)
    results: dict[str, Any] = {}
    with distributed(timeout=scaled(LONG)):  # everyone started: the scenarios begin together
        wait_for_everyone()
    results["stall"] = _attempt(stall_in_forward(root))
    results["stall_in_save"] = _attempt(stall_in_save(root))
    results["leave_backward"] = _attempt(leave_then_backward)
    results["leave_barrier"] = _attempt(leave_then_barrier)
    results["leave_debug"] = _attempt(leave_then_debug_check)
    if int(os.environ["WORLD_SIZE"]) == 2:
        results["rank_only"] = {}
        results["rank_only_end"] = _attempt(lambda: rank_only_calls(root, results["rank_only"]))
        results["main_first"] = _attempt(main_first_collective)
    return results


def launched_stall(folder: str) -> None:
    """For launch(fn): rank 1 stalls in forward at step 3."""
    stall_in_forward(Path(folder))()


def rank_dies() -> tuple[str, str, Any, float]:
    """Rank 1's process ends without a word at step 2 (os._exit): the others name it."""
    return _attempt(_dies_at_step_2)


def _dies_at_step_2() -> None:
    with distributed(timeout=scaled(LONG)):
        torch.manual_seed(0)
        _train(nn.Linear(4, 2), 6, stop=lambda s: state().rank == 1 and s == 2 and os._exit(3))


class _SleepySplit(Sleepy):
    """Sleepy with a layer before: colwise then rowwise, whose forward all-reduces over tp."""

    def __init__(self, flag: Path, rank: int, step: int) -> None:
        super().__init__(flag, rank, step)
        self.up = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.up(x))


def stalled_on_a_mesh(folder: str) -> tuple[str, str, Any, float]:
    """Rank 1 of 4 stalls in its forward at step 3 under ``sharded(tp=2)``, whose collectives
    run on the subgroups of a 2-D mesh: the others must give up within distributed()'s timeout
    there too, and name it."""
    from accel_ctx import sharded

    flag = Path(folder) / "mesh-gave-up"

    def scenario() -> None:
        try:
            with distributed(timeout=scaled(STALL_TIMEOUT)), sharded(
                    tp=2, tp_plan={"up": "colwise", "lin": "rowwise"}):
                torch.manual_seed(0)
                _train(_SleepySplit(flag, 1, 3), 6)
        finally:
            if os.environ["RANK"] != "1":
                flag.touch()

    return _attempt(scenario)
