"""What a ``resumable()`` run notes about the shape of its loop, and what it does about it.

A restart can go on exactly only where the loop knows where it stopped: a DataLoader (its
position is saved), ``run.epochs(n)`` (the epoch under way) or ``run.step`` (a loop bound by
steps). So a run notes which the loop uses, and:

- inside an epoch of ``run.epochs()`` whose batches come from no DataLoader (a tensor or a list
  iterated by the loop, which nothing can make skip the batches trained), it saves at the
  epoch's end only: a restart trains the epoch under way again from its start, exactly;
- a resumed loop that uses none of the three is refused at its first optimizer step (it would
  train its steps again from the first);
- a resumed loop that counts its epochs with ``range(n)`` is warned about once (it trains more
  epochs than the run was to); where ``state()`` or ``run.step`` was read before its first
  loader iteration (a log line, or ``while state().step < N:``) this is decided at the
  loader's second pass: a loop bound by steps reads the step between the two.
"""

from __future__ import annotations

import gc
import logging
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from .._checkpoint.resume_run import ResumeRuntime
from .._kernel.concern import ForwardCall
from .._kernel.session import Session
from .._warn import warn_user
from ..errors import ConfigurationError

log = logging.getLogger("accel_ctx.checkpoint")


class LoopRun(ResumeRuntime):
    """A ``resumable()`` runtime that notes how its loop counts (see the module)."""

    epochs_called = False  # run.epochs() was iterated
    step_first = False  # run.step or state() was read before the first loader iteration
    loader_seen = False
    epoch_start: int | None = None  # the step run.epochs()'s epoch under way began at
    deferred = False  # a save due inside such an epoch: taken at its end
    hold = False  # a decorated call: its function's locals (the model...) go before the end
    stepped = False
    copy_said = False  # the warning about a model's copy unknown to the run, once
    range_loader: weakref.ref[Any] | None = None  # the loader whose next pass decides
    range_pass: Any = None  # its first pass (a LoaderIteration)
    read_outside = False  # run.step or state() read while no loader pass was under way

    def __init__(self, folder: Path, every_steps: int | None, every_minutes: float | None,
                 keep_last: int) -> None:
        super().__init__(folder, every_steps, every_minutes, keep_last)
        self.held: list[Any] = []

    def newest(self) -> Path | None:
        """The newest checkpoint this run published (the save in flight waited for, on every
        rank alike: an object met late loads from it, as it carries the entries not met)."""
        self.saver.wait()
        return self.saver.last_path

    def noted_read(self) -> None:
        """``run.step`` or ``state()`` read in the loop's thread."""
        self.step_first = self.step_first or not self.loader_seen
        self.read_outside = self.read_outside or not self.session.loaders

    @override
    def snapshot(self) -> dict[str, Any]:
        self.noted_read()
        return super().snapshot()

    @override
    def key_of(self, obj: Any, kind: str) -> tuple[str, bool]:
        key, new = super().key_of(obj, kind)
        if new and self.hold:
            self.held.append(obj)  # the final checkpoint, saved after the function returned
        return key, new

    @override
    def close(self, exc: BaseException | None) -> None:
        try:
            super().close(exc)
        finally:
            self.held = []

    # ---- a copy of a model made before its restore (an EMA by copy.deepcopy) -------------------
    @override
    def before_forward(self, call: ForwardCall, session: Session) -> None:
        module = call.module
        checkpoint = self.checkpoint
        if checkpoint is None or self.rank != 0 or module in self.keys:
            super().before_forward(call, session)
            return
        copies = _copies(module, {id(m) for m in (*self.tracked.values(), *self.keys.keys())})
        super().before_forward(call, session)
        key = self.keys.get(module)
        if copies and key is not None and key in checkpoint.names and not self.copy_said:
            self.copy_said = True
            names = type(copies[0]).__name__
            warn_user(
                f"resumable({self.folder}): a {names} holds the weights {key!r} was built with, "
                "before this restart restored it: a copy made before the model's first forward "
                "(e.g. an EMA by copy.deepcopy(model)) and not run.track()ed, so it goes on from "
                "the script's fresh weights, not from the run's. Name it as you build it, "
                "run.track(ema=ema_model), to have it saved and restored with the run.")

    # ---- run.epochs() over batches from no DataLoader --------------------------------------------
    @override
    def unsavable(self, session: Session) -> str:
        start = self.epoch_start
        if start is None or session.loaders or session.step == start:
            return ""
        last = self.saver.last_path
        since = f"{last.name}, step {self.saver.last_saved}" if last else "a fresh start"
        return (f"step {session.step} was not saved: it is {session.step - start} steps into "
                f"epoch {self.meta.next_epoch} of run.epochs(), whose batches come from no "
                "DataLoader, so a restart could not go on from its next batch; it starts that "
                f"epoch again from its start ({since}), exactly")

    @override
    def defer(self) -> None:
        self.deferred = True

    def epoch_ended(self) -> None:
        """run.epochs()'s epoch ended (a step boundary): a save deferred to it is taken."""
        self.epoch_start = None
        if self.deferred and self.opened:
            self.deferred = False
            self.checked_step = self.session.step  # this step's boundary: here
            self.save()

    # ---- a resumed loop that cannot know where it stopped ----------------------------------------
    @override
    def before_step(self, session: Session) -> None:
        if not self.stepped:
            self.stepped = True
            self._check_the_loop(session)
        super().before_step(session)

    def _check_the_loop(self, session: Session) -> None:
        checkpoint = self.checkpoint
        if (checkpoint is None or self.epochs_called or self.step_first or session.loaders
                or self.epoch_start is not None):
            return
        raise ConfigurationError(
            f"resumable({self.folder}): this run resumes from {checkpoint.folder.name} (step "
            f"{checkpoint.step}{', finished' if self.meta.finished else ''}), but its loop "
            "knows neither where it stopped nor how far to go: its batches come from no "
            "DataLoader, and it reads neither run.step (state().step) nor run.epochs(), so it "
            "would train its steps again from the first (a loop over a tensor or a list, `for "
            "x in xs:`). Loop on the step (`while run.step < total: x = xs[run.step % "
            "len(xs)]`; in a function decorated with @resumable(...), state().step), or count "
            "the epochs with `for epoch in run.epochs(n):` (a restart starts the epoch under "
            "way again), or iterate a DataLoader (its position is saved).")

    # ---- a resumed loop counting its epochs with range(n) -------------------------------------
    def loop_met(self, loader: Any, record: Any) -> None:
        """A loader's first iteration (a session loader hook)."""
        if self.loader_seen:
            return
        self.loader_seen = True
        checkpoint = self.checkpoint
        if (checkpoint is None or self.epochs_called or self.rank != 0
                or not any(int(e["epoch"]) > 0 for e in checkpoint.shared["loaders"])):
            return
        if not self.step_first:
            self._say_range()
        else:  # a log line or `while state().step < N:`: its second pass tells
            self.range_loader = weakref.ref(loader)

    @override
    def before_batch(self, session: Session) -> None:
        if self.range_loader is not None:
            self._check_range(session)
        super().before_batch(session)

    def _check_range(self, session: Session) -> None:
        iteration = session.driving_loader()
        if iteration is None or self.range_loader is None:
            return
        if iteration.loader is not self.range_loader():
            return
        if self.range_pass is None:
            self.range_pass, self.read_outside = iteration, False
        elif iteration is not self.range_pass:
            self.range_loader = self.range_pass = None
            if not self.read_outside and not self.epochs_called:
                self._say_range()

    def _say_range(self) -> None:
        checkpoint = self.checkpoint
        log.warning(
            "resumable(%s): resumed at step %d, past the first epoch's start, but this loop "
            "counts its epochs itself: `for epoch in range(n)` starts again at epoch 0 and "
            "trains more epochs than the run was to. Count them with `for epoch in "
            "run.epochs(n)` (or loop on run.step: `while run.step < max_steps`).",
            self.folder, checkpoint.step if checkpoint is not None else self.session.step)


def _copies(module: Any, known: set[int]) -> list[nn.Module]:
    """The other live modules of ``module``'s class with its very parameters (not its own
    submodules, not ``known``): copies made of it (this rank; looked for once per model met)."""
    params = [p.detach() for p in module.parameters()]
    if not isinstance(module, nn.Module) or not params or any(
            hasattr(p, "device_mesh") for p in params):
        return []  # sharded: the copies hold other tensors (or none) by then
    mine = {id(p) for p in module.parameters()}
    found = []
    for obj in gc.get_objects():
        if (type(obj) is not type(module) or obj is module or id(obj) in known):
            continue
        theirs = [p.detach() for p in obj.parameters()]
        if (len(theirs) != len(params) or any(id(p) in mine for p in obj.parameters())
                or any(a.shape != b.shape or hasattr(b, "device_mesh")
                       for a, b in zip(params, theirs, strict=True))):
            continue
        if all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(params, theirs, strict=True)):
            found.append(obj)
    return found
