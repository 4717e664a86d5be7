"""``resumable()``: a run that is killed at any moment carries on by itself from its last save.

The scope finds the newest complete checkpoint in its folder on entry and restores each object
as the loop meets it; it saves at step boundaries every ``every_steps`` steps and/or
``every_minutes``, on SIGTERM/SIGUSR1 (then exits to be restarted), and when the run ends. The
runtime is ``resume_run``; the checkpoint's reading ``restore``; the signals ``preempt``.
"""

from __future__ import annotations

import json
import os
import weakref
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from typing_extensions import Self, override

from .._checkpoint import files
from .._checkpoint.restore import META, is_loader
from .._hooks.scope import Scope, _Entry
from .._kernel import state as _state
from .._kernel.concern import Concern
from .._options import checked, file_path, positive, whole
from ..errors import ConfigurationError
from .resumable_entry import Run, enter, leave, make

__all__ = ["resumable"]


@checked
class resumable(Scope):
    """Make the run resumable: restore on entry, save at step boundaries, survive a kill.

    The scope's folder keeps the run's checkpoints (``save_state``'s format, the newest
    ``keep_last``). On entry it finds the newest complete one (none: a fresh start, said once)
    and restores each object as the loop meets it, before it is used: models at their first
    forward (after adoption, so moved or sharded as they train), optimizers just before their
    first step, LR schedulers at their first ``step()``, DataLoaders at ``iter()`` (the epoch
    goes on with the first batch it had not trained on, in the same order), the RNG streams and
    the loss scale and accumulation state at the first batch, forward or step (after the
    script's own ``torch.manual_seed``). Objects are keyed by the order the same script meets
    them (``model0``, ``optimizer0``, ``scheduler0``, loaders by first iteration) and anything
    else is named with :meth:`track`; an object that does not match its saved state is refused
    with a ``CheckpointError`` naming both.

    It saves every ``every_steps`` optimizer steps and/or ``every_minutes``, on every rank, at
    a step boundary: the next batch fetched (or forward) after ``opt.step()``, so never inside
    an accumulation group nor between ``opt.step()`` and ``sched.step()``. A failed save
    (a full disk) warns and training goes on. SIGTERM or SIGUSR1 on any rank makes every rank
    save at the next boundary and exit with code 128 + the signal's number, which
    ``accel-ctx launch --max-restarts K`` (and a SLURM requeue) restarts; the restarted run
    continues with the same weights, optimizer state, data order and random streams as if it
    had never stopped (same number of processes: bit-identical). A run that ends normally
    leaves a final checkpoint; starting the finished script again takes no step and says so.

    Args:
        folder: where the checkpoints live; one run (one script) per folder.
        every_steps: save after every so many optimizer steps (None: not by steps).
        every_minutes: save at the first boundary after so many minutes since the last save.
        keep_last: how many checkpoints to keep (>= 1).

    Examples:
        >>> import tempfile, torch
        >>> from accel_ctx import distributed, resumable
        >>> folder = tempfile.mkdtemp()
        >>> def train():
        ...     with distributed(), resumable(folder, every_steps=2) as run:
        ...         model = torch.nn.Linear(4, 1)
        ...         opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ...         for epoch in run.epochs(2):
        ...             for x in torch.ones(3, 2, 4):
        ...                 model(x).sum().backward(); opt.step(); opt.zero_grad()
        ...         return run.step
        >>> train()
        6
        >>> train()  # finished: nothing left to run
        6
    """

    def __init__(self, folder: str | os.PathLike[str], every_steps: int | None = None,
                 every_minutes: float | None = None, keep_last: int = 2) -> None:
        super().__init__()
        file_path("resumable", "folder", folder)
        if every_steps is not None:
            whole("resumable", "every_steps", every_steps, 1,
                  "give a number of optimizer steps >= 1, or None.")
        if every_minutes is not None:
            positive("resumable", "every_minutes", every_minutes,
                     "give a positive number of minutes, or None.")
        whole("resumable", "keep_last", keep_last, 1,
              "give how many checkpoints to keep, a whole number >= 1.")
        self._folder = Path(folder)
        self._every_steps = every_steps
        self._every_minutes = every_minutes
        self._keep_last = keep_last
        self._ended: Run | None = None
        # a decorated call runs in a clone: the decorator object reads the clone's run
        self._origin: resumable = self
        self._clones: weakref.WeakSet[resumable] = weakref.WeakSet()

    # ---- the scope -----------------------------------------------------------------------------
    @override
    def _clone(self) -> Self:
        clone = super()._clone()
        clone._origin = self._origin
        self._origin._clones.add(clone)
        return clone

    @override
    def _open(self, exits: ExitStack) -> Concern:
        runtime = make(self._folder, self._every_steps, self._every_minutes, self._keep_last)
        runtime.hold = self._origin is not self  # a decorated call

        def close(exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
            try:
                runtime.close(exc)
            finally:
                leave(runtime)
                self._ended = self._origin._ended = runtime  # read after: `print(run.step)`
            return False

        exits.push(close)
        return runtime

    @override
    def _activate(self, entry: _Entry) -> None:
        super()._activate(entry)
        runtime = entry.frame.runtimes[0]
        assert isinstance(runtime, Run) and entry.stack is not None
        if runtime.entered:
            return  # a decorated generator resumed
        try:
            enter(runtime, entry.stack)
        except BaseException:
            leave(runtime)
            _state.pop(entry.stack, entry.token)  # type: ignore[arg-type]
            entry.stack = entry.token = None
            raise

    # ---- the run ---------------------------------------------------------------------------------
    def _runtime(self, after_the_block: bool = False) -> Run:
        thread = _state._get_ident()
        entries = [*self._entries, *(e for c in list(self._clones) for e in c._entries)]
        for entry in reversed(entries):
            runtime = entry.frame.runtimes[0]
            if entry.thread == thread and isinstance(runtime, Run):
                runtime.need()  # a run whose folder opens when first needed: now
                return runtime
        if after_the_block and self._ended is not None:
            return self._ended  # what the run ended with, read only
        raise ConfigurationError(
            "resumable(): use the run inside its `with resumable(...) as run:` block, or inside "
            "the function it decorates (after them, only run.step, run.resumed, run.finished, "
            "run.checkpoint and run.values can be read).")

    @property
    def step(self) -> int:
        """Optimizer steps completed, restored on entry (a step-based loop:
        ``while run.step < max_steps``). In a loop that iterates no DataLoader, reading it is
        the step boundary (a save may happen there) and, after a restart, the first read
        restores the RNG streams: read it at the top of the loop, after the model is built."""
        runtime = self._runtime(after_the_block=True)
        if runtime.opened:
            runtime.noted_read()
            runtime.step_read()
        return runtime.session.step

    @property
    def resumed(self) -> bool:
        """Whether the run continues from a checkpoint."""
        return self._runtime(after_the_block=True).checkpoint is not None

    @property
    def finished(self) -> bool:
        """Whether the run had already ended: its loop takes no step, and objects it never
        meets are not restored (track the ones the code after the loop uses)."""
        return self._runtime(after_the_block=True).meta.finished

    @property
    def checkpoint(self) -> Path | None:
        """The checkpoint folder the run resumed from (None: a fresh start)."""
        found = self._runtime(after_the_block=True).checkpoint
        return found.folder if found is not None else None

    @property
    def values(self) -> dict[str, Any]:
        """The plain values given to :meth:`track`, as restored (update them in place)."""
        return self._runtime(after_the_block=True).meta.values

    def epochs(self, n: int) -> Iterator[int]:
        """The epochs left of ``n``: ``range(n)`` on a fresh start, from the saved epoch after a
        restart (whose DataLoader goes on with the batches that epoch had not seen)."""
        whole("run.epochs", "n", n, 0)
        runtime = self._runtime()
        runtime.epochs_called = True
        meta = runtime.meta
        for epoch in range(runtime.start_epoch(), n):
            meta.next_epoch = epoch
            runtime.epoch_start = runtime.session.step
            yield epoch
            meta.next_epoch = epoch + 1
            runtime.epoch_ended()

    def track(self, **objects: Any) -> None:
        """Save and restore more objects, by name: anything with ``state_dict`` /
        ``load_state_dict`` (an EMA model, a GradScaler, a metric), DataLoaders, and plain
        values (numbers, strings, lists, dicts: read and update them in ``run.values``).
        Objects are restored at once (optimizers at their first step)."""
        runtime = self._runtime()
        for name, obj in objects.items():
            if name == META or name.rstrip("0123456789") in runtime.met:
                raise ConfigurationError(
                    f"run.track({name}=...): {name!r} is a name resumable() gives itself; "
                    "choose another one.")
            if callable(getattr(obj, "state_dict", None)) or is_loader(obj):
                if is_loader(obj):
                    _track_loader(runtime, name, obj)
                runtime.track(name, obj)
                continue
            try:
                json.dumps(obj)
            except (TypeError, ValueError):
                raise ConfigurationError(
                    f"run.track({name}=...): a {type(obj).__name__} has no state_dict(); give "
                    "objects with state_dict()/load_state_dict() or plain values (numbers, "
                    "strings, lists, dicts)."
                ) from None
            runtime.meta.values.setdefault(name, obj)


def _track_loader(runtime: Run, name: str, loader: Any) -> None:
    from .._data import records
    from .._data.position import apply_position

    checkpoint = runtime.checkpoint
    if checkpoint is None:
        return
    saved = checkpoint.shared["loaders"]
    generators = (checkpoint.mine or files.load_torch(
        checkpoint.folder / files.rank_file(0)))["generators"]
    for entry, generator in zip(saved, generators, strict=True):
        if entry["name"] == name:
            apply_position(loader, records.loader_record(loader), entry, generator)
