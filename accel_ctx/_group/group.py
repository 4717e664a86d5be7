"""Forming the job: launch environment -> process group -> device, and leaving it.

``start_job`` reads the launch environment, joins (or adopts) the process group, picks and sets
the device, and registers on the entry's ``ExitStack`` everything that undoes it: the group's
destruction, the previous CUDA device, and the exit announcement that lets the other ranks'
next wait fail at once, naming this rank.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import replace

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store

from .._job import comm_hook as _comm_hook
from .._job import env as _env
from .._job.coordinates import Coordinates
from .._job.heartbeat import Heartbeat
from .._job.job import Job, close_process_job, open_process_job
from .._job.options import DistributedOptions
from .._job.placement import check_backend, pick_backend, pick_device
from .._job.progress import FAILED, LEFT
from .._kernel import state as _state
from ..errors import DistributedError, LaunchEnvironmentError, RendezvousError
from . import rendezvous as _rendezvous
from .barrier import announce_failure, store_and_prefix
from .blame import write_error_file
from .skipped import UnsyncedSteps
from .stuck import StuckWatch


class _Stores:
    """Rendezvous stores, kept for the process's next scopes: a TCPStore server torn down while
    a peer reconnects for the next scope would race. Each process group formed on a store uses a
    key prefix of its own generation."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stores: dict[tuple[str, int, int], Store] = {}
        self._generation = 0

    def get(self, key: tuple[str, int, int]) -> Store | None:
        with self._lock:
            return self._stores.get(key)

    def keep(self, key: tuple[str, int, int], store: Store) -> None:
        with self._lock:
            self._stores[key] = store
        _state.close_at_exit(self.forget)  # before interpreter teardown, not during it

    def next_generation(self) -> int:
        with self._lock:
            self._generation += 1
            return self._generation

    def forget(self) -> None:
        """Before the interpreter's teardown: close them, not during it."""
        with self._lock:
            self._stores.clear()

    def forget_in_child(self) -> None:
        """A forked child (a DataLoader worker) has none of its parent's connections. The
        parent's store objects stay referenced, never destroyed here: a FileStore's destructor
        would unregister from the file the parent's job still rendezvouses on."""
        self._lock = threading.Lock()
        _state.leave_to_the_parent(self._stores)
        self._stores = {}


_stores = _Stores()
_state.reset_after_fork(_stores.forget_in_child)


def start_job(options: DistributedOptions, exits: ExitStack,
              on_job: Callable[[Job, ExitStack], None] | None = None) -> Job:
    """Form the job of an outermost ``distributed()``; its undo goes on ``exits``."""
    launch = _env.detect()
    backend: str | None = None
    if dist.is_available() and dist.is_initialized():
        # The user (or a library) already formed the group: use it, leave it to them.
        launch = _launch_from_group(launch)
        device = pick_device(options, launch)
        _comm_hook.check_device(options.comm_hook, device)
        backend = str(dist.get_backend())
    else:
        device = pick_device(options, launch)
        _comm_hook.check_device(options.comm_hook, device)  # a refusal before the group forms
        if launch.is_distributed:
            backend = pick_backend(options, device)
            _init_process_group(launch, options, backend, device)
            exits.callback(dist.destroy_process_group)
    if device.type == "cuda":
        previous = torch.cuda.current_device()
        torch.cuda.set_device(device)
        exits.callback(torch.cuda.set_device, previous)
    job = Job(launch, device, backend, options)
    open_process_job(job)
    exits.callback(close_process_job, job)
    if on_job is not None:  # the scope's own undo (engines released, a last evaluation's verdict)
        on_job(job, exits)
    _watch(job, exits)
    exits.push(job.end)  # first of all: the group, engines and watch are all still there
    return job


def _store_key(launch: _env.LaunchEnv, options: DistributedOptions) -> tuple[str, int, int]:
    init_method = options.init_method or launch.init_method
    target = init_method or f"tcp://{launch.master_addr}:{launch.master_port}"
    return (target, launch.coordinates.rank, launch.coordinates.world_size)


def _init_process_group(
    launch: _env.LaunchEnv, options: DistributedOptions, backend: str, device: torch.device
) -> None:
    """Reach the store, wait there for every rank (with progress lines), form the group."""
    init_method = options.init_method or launch.init_method
    address = _rendezvous.address_of(launch, init_method)
    where = f"rank {launch.coordinates.rank} of {launch.coordinates.world_size} ({launch.source}, rendezvous at {address})"
    seconds = options.timeout.total_seconds()
    check_backend(backend, device)
    waiter = _rendezvous.Waiter(launch, address, options.timeout)
    key = _store_key(launch, options)
    try:
        base: Store | None = _stores.get(key)
        if base is None:
            base = _rendezvous.connect(launch, init_method, options.timeout, waiter)
        # A fresh key prefix per process group: sequential scopes and elastic restarts reuse
        # the same store, and must not see each other's barrier counters.
        generation = _stores.next_generation()
        store = PrefixStore(f"accel_ctx/{launch.restart_count}/{generation}", base)
        _rendezvous.await_peers(store, launch, waiter)
        dist.init_process_group(
            backend,
            store=store,
            rank=launch.coordinates.rank,
            world_size=launch.coordinates.world_size,
            timeout=options.timeout,
        )
        _rendezvous.await_formed(store, launch, waiter)  # no rank leaves one still connecting
        # Kept for the process's next scopes only once a group formed with it.
        _stores.keep(key, base)
    except (RendezvousError, LaunchEnvironmentError):
        raise
    except Exception as exc:
        if waiter.left() > 0.1 * seconds and "timeout" not in str(exc).lower():
            raise DistributedError(
                f"{where}: the process group could not be set up: {exc}"
            ) from exc
        raise RendezvousError(
            f"{where}: the process group did not form within {seconds:g} s ({exc}). Check that "
            f"all {launch.coordinates.world_size} processes were started with the same MASTER_ADDR/"
            "MASTER_PORT and can reach rank 0; raise distributed(timeout=...) if start-up is slow."
        ) from exc


def _launch_from_group(launch: _env.LaunchEnv) -> _env.LaunchEnv:
    rank, world = dist.get_rank(), dist.get_world_size()
    if launch.is_distributed and (launch.coordinates.rank, launch.coordinates.world_size) != (rank, world):
        raise LaunchEnvironmentError(
            f"the process group already initialised says rank {rank} of {world}, the "
            f"environment says rank {launch.coordinates.rank} of {launch.coordinates.world_size}; make them agree."
        )
    if not launch.is_distributed:
        # no launcher variables: assume one machine, as the group's creator most likely did
        return replace(launch, source="process group",
                       coordinates=Coordinates.of(rank, world, rank, world, 0, 1))
    return replace(launch, coordinates=replace(launch.coordinates, rank=rank,
                                               world_size=world, dp_rank=rank, dp_size=world))


def _watch(job: Job, exits: ExitStack) -> None:
    """Start the job's heartbeat (several processes) and announce its exit to the others."""

    def announce_exit(exc_type: type[BaseException] | None, exc: BaseException | None,
                      tb: object) -> bool:
        """Leaving, by an exception or not: the other ranks' next sync point fails at once,
        naming this rank, and its last record says "left" or "failed" (see ``_group.blame``)."""
        beat, job.heartbeat = job.heartbeat, None
        job.progress.on_unsynced_step = None
        if beat is not None:
            beat.stop()
            # the watch holds the heartbeat: left as a cycle, the heartbeat's own store client
            # would be destroyed by a later garbage collection, and a FileStore's destructor
            # then removes the file the process's next job is meeting on (its ranks hung)
            beat.on_beat = None
        if job.world_size == 1 or not dist.is_initialized():
            return False
        progress = job.progress
        where = progress.describe()
        if exc is None:
            progress.state = LEFT
            announce_failure(job, f"rank {job.rank} left distributed() at {where}", "left")
        else:
            text = f"{type(exc).__name__}: {exc}"
            culprit = getattr(exc, "culprit", None)  # our DistributedError naming a rank
            if progress.state != FAILED:  # not already failed naming someone else (_blame)
                progress.state, progress.detail = FAILED, text[:1000]
                if isinstance(culprit, int) and culprit != job.rank:
                    progress.blames = [culprit]
            if isinstance(culprit, int):  # for `accel-ctx launch`'s last line and exit code
                write_error_file(exc, culprit, exc)
            announce_failure(job, f"rank {job.rank} left distributed() with {text} at {where}")
        if beat is not None:
            beat.publish(dist.distributed_c10d._get_default_store())
        return False

    exits.push(announce_exit)
    if job.world_size > 1 and dist.is_initialized():
        store, prefix = store_and_prefix(job)
        beat = Heartbeat(job.progress, job.rank, store, f"{prefix}/progress/{job.rank}",
                         job.world_size)
        beat.on_beat = StuckWatch(job, beat)  # a collective that can never complete ends
        job.progress.on_unsynced_step = UnsyncedSteps(job, beat)  # a step with no backward
        job.heartbeat = beat
        beat.start()
