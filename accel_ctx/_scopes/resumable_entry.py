"""How a ``resumable()`` entry opens its folder: now, or when the loop first needs it.

One process, or a scope entered inside ``distributed()``: at once, as the scope is entered.
One rank of several (the launcher's ``WORLD_SIZE``) with no process group yet (``resumable()``
entered before ``distributed()``): every rank would take itself for rank 0 and fight over the
folder's lock, so the folder is opened at the loop's first need (a loader's first iteration,
the first batch, forward, optimizer or scheduler step, a read of ``run``), when the inner
``distributed()`` has formed the group; its final checkpoint is then written as that job ends,
before the group goes.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from typing_extensions import override

from .._checkpoint import dcp as objs
from .._checkpoint import files, find, guard
from .._checkpoint.restore import Checkpoint, new_group
from .._checkpoint.resume_run import ResumeRuntime
from .._job import env as _env
from .._kernel import state as _state
from .._kernel.concern import ForwardCall
from .._kernel.session import Session
from ..errors import CheckpointError, ConfigurationError, LaunchEnvironmentError
from .resumable_loop import LoopRun

RUN_LOCK = ".run.lock"
log = logging.getLogger("accel_ctx.checkpoint")


class Run(LoopRun):
    """A ``resumable()`` entry's runtime, with what its entry and ``run`` note about the loop."""

    pending: Callable[[], None] | None = None  # opens the folder: deferred to the first need
    entered = False
    loader_hooks: tuple[Any, ...] = ()  # ours in the session's loader hooks (shared with
    # the scopes outside): taken out as the entry ends

    def need(self) -> None:
        """The loop needs the run: open the folder if its opening was deferred."""
        pending = self.pending
        if pending is not None:
            self.pending = None
            pending()


class DeferredRun(Run):
    """A run whose folder opens at the loop's first need (see the module)."""

    @override
    def before_forward(self, call: ForwardCall, session: Session) -> None:
        self.need()
        super().before_forward(call, session)

    @override
    def before_batch(self, session: Session) -> None:
        self.need()
        super().before_batch(session)

    @override
    def first_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.need()
        super().first_optimizer(optimizer)

    @override
    def before_step(self, session: Session) -> None:
        self.need()
        super().before_step(session)

    @override
    def before_schedule(self, scheduler: Any, session: Session) -> None:
        self.need()
        super().before_schedule(scheduler, session)


def make(folder: Path, every_steps: int | None, every_minutes: float | None,
         keep_last: int) -> Run:
    """The entry's runtime: deferred when this is one rank of several with no group yet."""
    kind = DeferredRun if _group_to_come() else Run
    return kind(folder, every_steps, every_minutes, keep_last)


def _group_to_come() -> bool:
    if objs.rank_world()[1] > 1:
        return False  # a job (or a group formed by hand) is there already
    try:
        return _env.detect().is_distributed
    except LaunchEnvironmentError:
        return False  # distributed() says what is wrong with the environment


def enter(runtime: Run, stack: _state.Stack) -> None:
    """The scope's entry: open the run now, or at the loop's first need."""
    runtime.entered = True
    if not isinstance(runtime, DeferredRun):
        open_run(runtime, stack)
        return
    runtime.pending = functools.partial(_open_late, runtime)
    session = runtime.session = stack.session  # the one the loop counts in, from the start

    def first_loader(loader: Any, record: Any) -> None:
        # A loader's first iteration: its saved position must be set before this iter() goes
        # on, so the hooks the opening installs are run for it here.
        session.loader_hooks.remove(first_loader)
        before = list(session.loader_hooks)
        runtime.need()
        for hook in list(session.loader_hooks):
            if hook not in before:
                hook(loader, record)

    session.loader_hooks.append(first_loader)
    runtime.loader_hooks = (first_loader,)


def _open_late(runtime: Run) -> None:
    stack = _state.current()
    world = objs.rank_world()[1]
    if stack is None or world == 1:
        where = os.environ.get("WORLD_SIZE", "several")
        raise ConfigurationError(
            f"resumable({runtime.folder}): this process is one of {where} started by a launcher, "
            "but no process group was formed: without distributed() every process would train "
            "alone and write the same folder. Open distributed() (or sharded()) too, e.g. "
            "`with distributed(), resumable(folder) as run:`.")
    _drop_loader_hooks(runtime, stack.session)  # opened by another need than a loader's
    open_run(runtime, stack)
    job = stack.job
    if job is not None:  # its final checkpoint is written before the group goes
        job.root.at_end.append(functools.partial(_end_with_job, runtime))


def _end_with_job(runtime: Run, exc: BaseException | None) -> None:
    try:
        runtime.close(exc)
    finally:
        _destroy_groups(runtime)


def open_run(runtime: Run, stack: _state.Stack) -> None:
    """Every rank: the folder (rank 0 checks it can write there and holds it), the group for
    the boundaries' agreement, the newest checkpoint, the signal handlers."""
    rank, world = objs.rank_world()
    root = runtime.folder
    error: BaseException | None = None
    if rank == 0:
        try:
            files.make_root(root)
            lock = guard.FolderLock(root)
            launch = stack.job.launch if stack.job is not None else None
            groups = launch is not None and launch.replica_groups > 1  # they share the folder
            lock.path = root / (f"{RUN_LOCK}.group{launch.replica_group}" if groups and launch
                                else RUN_LOCK)
            try:
                runtime.lock = lock.acquire()
            except CheckpointError:
                raise CheckpointError(
                    f"resumable({root}): another run is using this folder ({lock._held()}). "
                    "Two runs in one folder would resume and rotate out each other's "
                    "checkpoints: give each run its own folder."
                ) from None
            probe = root / f".write-test-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except CheckpointError as exc:
            error = exc
        except OSError as exc:
            error = CheckpointError(
                f"resumable({root}): cannot write checkpoints there ({exc}). Give a folder "
                "this job can write to.")
    objs.agree(error, f"open the run folder {root}")
    job = stack.job
    group = new_group(world, job.options.timeout if job is not None else None)
    runtime.group = group
    runtime.saver.group = new_group(world)  # the writer thread's collectives: see saver
    folder = find.choose(root, rank, world, False, f"resumable({root})")
    checkpoint = Checkpoint(folder, rank, world) if folder is not None else None
    # Before the restore: a signal while it runs is kept for the first boundary (a kill
    # while restoring would lose nothing, but could not say why it ended).
    runtime.uninstall = runtime.signals.install()
    runtime.open(stack, checkpoint, group, rank, world)
    if checkpoint is not None:
        checkpoint.follow = runtime.newest
    hook = runtime.loop_met
    stack.session.loader_hooks.append(hook)
    runtime.loader_hooks = (hook,)
    if checkpoint is not None and rank == 0 and not runtime.meta.finished:  # it said so
        log.warning("resumable(%s): resuming from %s (step %d, epoch %d)%s", root,
                    checkpoint.folder.name, checkpoint.step, runtime.start_epoch(),
                    "" if checkpoint.same_world else
                    f"; resumed on {world} processes, the checkpoint was written by "
                    f"{checkpoint.saved_world}: the data not yet seen is split among {world}, so "
                    "the run continues correctly but not bit-identically")


def _drop_loader_hooks(runtime: Run, session: Session) -> None:
    for hook in runtime.loader_hooks:
        if hook in session.loader_hooks:
            session.loader_hooks.remove(hook)
    runtime.loader_hooks = ()


def leave(runtime: Run) -> None:
    _drop_loader_hooks(runtime, runtime.session)
    uninstall = runtime.uninstall
    if uninstall is not None:
        runtime.uninstall = None
        uninstall()
    lock = runtime.lock
    if lock is not None:
        runtime.lock = None
        lock.release()
    _destroy_groups(runtime)


def _destroy_groups(runtime: ResumeRuntime) -> None:
    groups = [g for g in (runtime.group, runtime.saver.group) if g is not None]
    runtime.group = runtime.saver.group = None
    if groups:
        import torch.distributed as dist

        for group in groups:
            if dist.is_initialized():
                dist.destroy_process_group(group)
