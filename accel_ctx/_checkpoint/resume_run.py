"""The runtime of one ``resumable()`` entry: objects keyed as met, restored, saved at boundaries.

**Keys.** Objects are keyed by their kind and the order first met: ``model0``, ``model1``
(first top-level forward), ``optimizer0`` (first ``step()`` or ``zero_grad()``),
``scheduler0`` (first ``step()``), DataLoaders by their first iteration; ``run.track(name=obj)``
names the others. A resumed run finds each object's saved key by what it is (``match``: a
model's parameter names, shapes and trainable ones, ...; a loader's data, batch size and
sampler), the order deciding among equals; an object unlike its saved state is refused.

**Restore as met.** On entry the counters (``run.step``) and loader positions; a model at its
first forward (after adoption: moved or sharded as it trains), an optimizer just before its
first step (its models met by then), a scheduler at its first ``step()`` before it decides,
the RNG streams and the concerns' state at the first batch, forward or step, so seeding in the
script never undoes a resume.

**Saves at a step boundary.** After an optimizer step, the next batch fetched (or the next
forward, for a loop without a DataLoader) is a boundary: never inside an accumulation group,
never between ``opt.step()`` and ``sched.step()``, before the next batch is drawn (so the saved
loader position and RNG states are exactly that step's). The ranks agree there (one small all-reduce)
whether a save is due or a preemption signal arrived; in replica groups one group writes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from typing_extensions import override

from .._kernel import state as _state
from .._kernel.concern import Concern, ForwardCall
from .._kernel.order import ORDER
from .._kernel.session import Session
from ..errors import CheckpointError
from . import match, saver
from . import restore as _restore
from .preempt import Preempted, Signals, requeue
from .restore import META, Checkpoint, Meta, is_loader, ordinal, script_name

log = logging.getLogger("accel_ctx.checkpoint")


class ResumeRuntime(Concern):
    """One entry of ``resumable()``."""

    slot, order = "resume", ORDER["resume"]

    def __init__(self, folder: Path, every_steps: int | None, every_minutes: float | None,
                 keep_last: int) -> None:
        self.folder = folder
        self.every_steps = every_steps
        self.every_minutes = every_minutes
        self.keep_last = keep_last
        self.signals = Signals()
        self.checkpoint: Checkpoint | None = None
        self.meta = Meta(script_name())
        self.stack: _state.Stack | None = None
        self.session = Session()
        self.group: Any = None
        self.world = 1
        self.rank = 0
        self.met: dict[str, dict[str, weakref.ref[Any]]] = {"model": {}, "optimizer": {},
                                                             "scheduler": {}}
        self.keys: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self.matcher = match.Matcher(self.keys, f"resumable({folder})")
        self.tracked: dict[str, Any] = {}
        self.carried: dict[str, Any] = {}  # the checkpoint's entries not met again yet
        self.unrestored: list[tuple[str, torch.optim.Optimizer]] = []
        self.process_restored = True
        self.early_rng: torch.Tensor | None = None  # what a restore left, until a forward
        self.start_step = self.checked_step = 0
        self.saver = saver.Saver(folder, keep_last, self.signals)
        self.opened = False
        self.lock: Any = None  # rank 0's hold on the folder (guard.FolderLock)
        self.uninstall: Callable[[], None] | None = None  # the signal handlers' undo

    # ---- entry and exit ------------------------------------------------------------------------
    def open(self, stack: _state.Stack, checkpoint: Checkpoint | None, group: Any,
             rank: int, world: int) -> None:
        self.stack, self.session = stack, stack.session
        self.checkpoint, self.group, self.rank, self.world = checkpoint, group, rank, world
        if checkpoint is not None:
            if META not in checkpoint.names:  # before the session's counters are touched
                raise _restore.not_a_run(self.folder, checkpoint)
            checkpoint.restore_session(stack)
            checkpoint.restore_loaders(stack, {})
            self.process_restored = False
            _restore.load_meta(checkpoint, self.meta)
            self._check_script()
        self.start_step = self.checked_step = self.session.step
        self.saver.last_saved = checkpoint.step if checkpoint is not None else -1
        self.saver.last_path = checkpoint.folder if checkpoint is not None else None
        self.session.loader_hooks.append(self._loader_met)
        self.opened = True

    def _check_script(self) -> None:
        loaded = self.meta.loaded or {}
        if (problem := _restore.check_script(self.folder, self.meta, loaded)) is not None:
            self._say(problem)  # the same script moved: it goes on
        self.meta.values.update(json.loads(loaded.get("values", "{}")))
        self.meta.next_epoch = int(loaded.get("epoch", 0))
        self.meta.finished = bool(loaded.get("finished", 0)) or (
            self.checkpoint is not None and saver.marked_finished(self.folder, self.checkpoint.folder))
        if self.meta.finished and self.checkpoint is not None:
            self._say(f"resumable({self.folder}): the run finished at step "
                      f"{self.checkpoint.step} (checkpoint {self.checkpoint.folder.name}): "
                      "nothing left to run.")

    def start_epoch(self) -> int:
        """The epoch ``run.epochs()`` starts at: the saved DataLoader's (the one under way, or
        the next when its last batch was trained), else the one ``run.epochs()`` was in."""
        checkpoint = self.checkpoint
        if checkpoint is None:
            return 0
        return checkpoint.epoch if checkpoint.shared["loaders"] else self.meta.next_epoch

    def close(self, exc: BaseException | None) -> None:
        if not self.opened:
            return
        self.opened = False
        if self._loader_met in self.session.loader_hooks:
            self.session.loader_hooks.remove(self._loader_met)
        if exc is not None:
            with contextlib.suppress(Exception):  # the save in flight publishes, if it can
                self.saver.wait()
            return
        self.saver.wait()
        if self.checkpoint is not None and self.session.step == self.start_step:
            if not self.meta.finished:
                self._say(f"resumable({self.folder}): no step was taken since checkpoint "
                          f"{self.checkpoint.folder.name} (step {self.session.step}).")
            self._say_unrestored(self.checkpoint)
            return
        last = self.saver.last_path
        if self.saver.last_saved == self.session.step and last is not None:
            if self.rank == 0:  # that save is the final checkpoint
                saver.mark_finished(self.folder, last)
            return
        self.meta.finished = True  # the final checkpoint: a run started again says so
        token = _state._STACK.set(self.stack)  # the scope's own stack, its counters
        try:
            self.save("at the end of the run", wait=True)
        finally:
            _state._STACK.reset(token)

    def _say_unrestored(self, checkpoint: Checkpoint) -> None:
        met = {*self.keys.values(), *self.tracked}
        if (text := _restore.unrestored(self.folder, checkpoint, set(self.met), met)) is not None:
            self._say(text)

    def _say(self, text: str) -> None:
        if self.rank == 0:
            log.warning("%s", text)

    # ---- meeting objects -----------------------------------------------------------------------
    def key_of(self, obj: Any, kind: str) -> tuple[str, bool]:
        """(its key, whether it was met just now)."""
        try:
            key = self.keys.get(obj)
        except TypeError:
            return "", False
        if key is not None:
            return key, False
        self.matcher.start(self.checkpoint)
        key = self.matcher.key(obj, kind, {*self.met[kind], *self.tracked})
        self.met[kind][key] = weakref.ref(obj)
        self.keys[obj] = key
        return key, True

    def track(self, name: str, obj: Any) -> None:
        self.tracked[name] = obj
        with contextlib.suppress(TypeError):  # not weakly referable: known by name only
            self.keys[obj] = name
        if isinstance(obj, torch.optim.Optimizer):
            self.unrestored.append((name, obj))  # its models may not be met yet
            return
        checkpoint = self.checkpoint
        if checkpoint is None or name not in checkpoint.names:
            return
        if callable(getattr(obj, "state_dict", None)) and not is_loader(obj):
            checkpoint.load(name, obj, {}, f"run.track({name}=...)")

    def _restore_process(self, boundary: bool = False) -> None:
        # Again at a boundary before any forward if something drew since (the model built after
        # a run.step read for a log line): the loop's order and first batch come after it.
        again = (boundary and self.early_rng is not None
                 and not torch.equal(torch.get_rng_state(), self.early_rng))
        if (self.process_restored and not again) or self.checkpoint is None:
            return
        self.process_restored = True
        if (stack := _state.current()) is not None:
            self.checkpoint.restore_process(stack)
            self.early_rng = torch.get_rng_state()

    def _loader_met(self, loader: Any, record: Any) -> None:
        self._restore_process(boundary=True)  # before the epoch draws its order from the RNG

    @override
    def before_forward(self, call: ForwardCall, session: Session) -> None:
        self._boundary(session)
        self._restore_process()
        self.early_rng = None  # training began: what it draws is the run's own
        key, new = self.key_of(call.module, "model")
        checkpoint = self.checkpoint
        if new and checkpoint is not None and key in checkpoint.names:
            what = f"the model called {ordinal(key)} ({type(call.module).__name__})"
            checkpoint.load(key, call.module, {}, what)

    def step_read(self) -> None:
        """``run.step`` read in the scope's thread: a boundary of a loop without a DataLoader
        (with one, its next batch is the boundary, and a read for a log line is none)."""
        if _state.current() is not None and not self.session.loaders:
            self._restore_process(boundary=True)
            self._boundary(self.session)

    @override
    def before_batch(self, session: Session) -> None:
        self._boundary(session)

    @override
    def first_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        key, new = self.key_of(optimizer, "optimizer")
        if not new:
            return
        checkpoint = self.checkpoint
        record = self.session.optimizers.get(optimizer)
        counters = checkpoint.optimizer_counters(key) if checkpoint is not None else None
        if record is not None and counters is not None:
            record.calls, record.real, record.last_group = counters
        self.unrestored.append((key, optimizer))

    @override
    def before_step(self, session: Session) -> None:
        self._restore_process()
        while self.unrestored:
            key, optimizer = self.unrestored.pop(0)
            checkpoint = self.checkpoint
            if checkpoint is None or key not in checkpoint.names:
                continue
            owners = {}
            for name in checkpoint.owners(key):
                model = self._object(name)
                if model is None:
                    raise CheckpointError(
                        f"resumable({self.folder}): the optimizer {key!r} was saved over the "
                        f"parameters of {name!r}, which this run has not met before the "
                        "optimizer's first step. Call the model before stepping, or name it "
                        "with run.track()."
                    )
                owners[name] = model
            what = f"the optimizer stepped {ordinal(key)} ({type(optimizer).__name__})"
            checkpoint.load(key, optimizer, owners, what)
            self.matcher.check_lr(key, optimizer, warn=self.rank == 0)

    @override
    def before_schedule(self, scheduler: Any, session: Session) -> None:
        if getattr(scheduler, "_step_count", 1) == 0:
            return  # the step its constructor takes: met at its first step() of the loop
        key, new = self.key_of(scheduler, "scheduler")
        checkpoint = self.checkpoint
        if not new or checkpoint is None or key not in checkpoint.names:
            return
        checkpoint.load(key, scheduler, {}, f"the scheduler stepped {ordinal(key)} "
                                            f"({type(scheduler).__name__})")
        seen = checkpoint.scheduler_counters(key)
        if seen is not None:
            session.schedulers[scheduler] = seen

    def _object(self, key: str) -> Any:
        if key in self.tracked:
            return self.tracked[key]
        ref = self.met.get(key.rstrip("0123456789"), {}).get(key)
        return ref() if ref is not None else None

    # ---- saves ---------------------------------------------------------------------------------
    def _boundary(self, session: Session) -> None:
        """The first batch or forward after a step: save if due or asked to."""
        if session.step == self.checked_step:
            return
        self.checked_step = session.step
        due = bool(self.every_steps) and session.step % (self.every_steps or 1) == 0
        if self.every_minutes is not None:
            due = due or time.monotonic() - self.saver.last_time >= 60 * self.every_minutes
        signum = self.signals.requested
        if self.world > 1 and self.group is not None:
            flags = torch.tensor([signum, int(due)], dtype=torch.int64)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
            signum, due = int(flags[0]), bool(flags[1])
        held = self.unsavable(session)  # a restart could not go on from this step
        if signum:
            self.signals.boundary_reached = True
            name = signal.Signals(signum).name
            self.saver.wait()  # a save under way publishes first
            held = held and self.unsavable(session)  # naming it
            path = self.save(f"on {name}", wait=True) if not held and \
                self.saver.last_saved != session.step else self.saver.last_path
            where = held or (f"saved {path}" if path is not None else
                             "the save failed (see above)") + f" at step {session.step}"
            message = (f"resumable({self.folder}): {name} received: {where}; exiting with code "
                       f"{128 + signum} for the launcher to restart the run.")
            if self.rank == 0:
                message += requeue()
                print(f"accel_ctx {message}", file=sys.stderr, flush=True)
            raise Preempted(signum, message)
        if due:
            self.defer() if held else self.save()

    def unsavable(self, session: Session) -> str:
        """Why this step's state cannot be resumed from ("": it can; see resumable_entry)."""
        return ""

    def defer(self) -> None:
        """A save due where ``unsavable()``: taken at the next step it can be."""

    def objects(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for refs in self.met.values():
            out.update((key, obj) for key, ref in refs.items()
                       if (obj := ref()) is not None and self.keys.get(obj) == key)
        out.update(self.tracked)
        out[META], out[match.ENTRY] = self.meta, self.matcher.entry
        checkpoint = self.checkpoint
        if checkpoint is None:
            return out
        loaders = {e.get("name") for e in checkpoint.shared["loaders"]}
        for name in sorted(checkpoint.names - out.keys() - loaders):
            if name not in self.carried:  # read once: the checkpoint may be rotated out later
                self.carried[name] = checkpoint.carry(name)
            out[name] = self.carried[name]
        return out

    def save(self, why: str = "", wait: bool = False) -> Path | None:
        """Save every object met or tracked, in the background (``wait``: until published)."""
        if self.stack and not all(c.writes_checkpoints() for c in self.stack.concerns):
            return None  # one healthy replica group writes the job's checkpoints
        return self.saver.save(self.objects(), self.session.step, why, wait, self.group)

    def superseded(self) -> None:
        """A live replica group's state replaced the checkpoint's: restore nothing more."""
        self.checkpoint, self.process_restored, self.early_rng, self.unrestored = None, True, None, []
