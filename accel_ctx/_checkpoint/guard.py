"""Guards around a save or a load: every rank arrives, one save per folder at a time, and a full
disk is called a full disk.

**Arrival.** ``save_state``, ``load_state`` and ``save_model`` are collective: called on rank 0
alone (under ``if state().is_main_process:``) their first collective would wait for ranks that
never come, then die with gloo's "Connection closed by peer". Before any collective they meet
through the rendezvous store, like ``_group.barrier``'s sync points: rank r writes
``n/arrived/r`` (the function it is in) and adds 1 to ``n/count``; the rank bringing the count
to the world size writes ``n/done = "ok"``. A rank that waited longer than the arrival timeout
writes ``n/done = "gave up: ..."`` instead (``compare_set``: whichever comes first wins), so the
ranks that came and any that comes later all raise, naming the ranks that never arrived.
The n-th checkpoint call of a process group is its point n (every rank counts its own).

**Folder lock.** Rank 0 holds an exclusive ``flock`` on ``DIR/.save.lock`` (holding its pid,
host and start time) from the start of a save to its end and deletes it then. A second save
into the same folder meanwhile, from another job or thread, is refused naming the holder. The
kernel drops the lock of a process that dies, so a lock file left by a killed save is taken
over by the next one. A child forked while the lock is held (a DataLoader worker) would share
it and keep it for seconds after its parent is killed, until it notices: each child closes its
copy as it starts.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import socket
import threading
import time
import weakref
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .._group import barrier as _barrier
from .._group.keywait import KeyWait
from .._job import progress as _progress
from .._job.env import seconds_from
from .._kernel import state as _state
from .._warn import warn_user
from ..errors import CheckpointError, ConfigurationError, DistributedError

ARRIVAL_ENV = "ACCEL_CTX_ARRIVAL_TIMEOUT"
MAX_ARRIVAL_WAIT = 60.0
LOCK = ".save.lock"
_OK = "ok"
_FULL = (errno.ENOSPC, errno.EDQUOT)


# ---- every rank arrives ------------------------------------------------------------------------
class _Points:
    __slots__ = ("completed", "prefix", "waits")

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.completed = 0
        self.waits: KeyWait | None = None


_points: weakref.WeakKeyDictionary[Any, _Points] = weakref.WeakKeyDictionary()
_groups = itertools.count(1)
_lock = threading.Lock()


def arrival_timeout() -> float:
    """Seconds to wait for the other ranks: ``ACCEL_CTX_ARRIVAL_TIMEOUT``, else the smaller of
    60 s and the process group's timeout."""
    seconds = seconds_from(ARRIVAL_ENV, "to wait for every rank to reach "
                           "save_state()/load_state()/save_model()", ConfigurationError)
    if seconds is not None:
        return seconds
    stack = _state.current()
    if stack is not None and stack.job is not None:
        group = stack.job.options.timeout.total_seconds()
    else:
        store: Any = dist.distributed_c10d._get_default_store()
        group = store.timeout.total_seconds()
    return min(MAX_ARRIVAL_WAIT, group) if group > 0 else MAX_ARRIVAL_WAIT


def arrive(call: str, names: Iterable[str] = ()) -> None:
    """Wait, for a bounded time, until every rank has called ``call`` ("save_state()") too,
    with the objects of the same ``names`` (a rank restoring fewer objects than the others
    would train on, silently apart from them)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    group = dist.group.WORLD
    store = dist.distributed_c10d._get_default_store()
    with _lock:
        record = _points.get(group)
        if record is None:
            record = _points[group] = _Points(f"accel_ctx/arrive/{next(_groups)}")
    rank, world = dist.get_rank(), dist.get_world_size()
    n = record.completed + 1
    point = f"{record.prefix}/{n}"
    seconds = arrival_timeout()
    job = _state.current_job()
    if job is not None:  # a wait: the heartbeat says so every 30 s, naming the others
        job.progress.enter(call)
    try:
        said = call.removesuffix(")") + ", ".join(f"{name}=" for name in sorted(names)) + ")"
        store.set(f"{point}/arrived/{rank}", said)
        if store.add(f"{point}/count", 1) == world:  # the last to arrive compares the calls
            calls = [c.decode() for c in store.multi_get(
                [f"{point}/arrived/{r}" for r in range(world)])]
            store.compare_set(f"{point}/done", "",
                              _OK if len(set(calls)) == 1 else json.dumps({"calls": calls}))
        try:
            if job is None or world == 1:
                store.wait([f"{point}/done"], timedelta(seconds=seconds))
            else:  # a rank that left distributed() or died will never come: end at once
                if record.waits is None:
                    record.waits = KeyWait(store)
                gone = _Gone(job, store, point, rank, world)
                record.waits.wait(f"{point}/done", seconds, gone.look,
                                  _barrier.look_interval(world))
            verdict = store.get(f"{point}/done").decode()
        except RuntimeError:  # a timeout: give up, unless the last rank came meanwhile
            missing = [r for r in range(world) if not store.check([f"{point}/arrived/{r}"])]
            gave_up = json.dumps({"rank": rank, "seconds": seconds, "missing": missing})
            verdict = store.compare_set(f"{point}/done", "", gave_up).decode()
    except RuntimeError as exc:
        raise DistributedError(
            f"rank {rank}: {call} lost the rendezvous store while waiting for every rank to "
            f"reach it ({exc}). The rank hosting it (rank 0 with a TCP store) has most likely "
            "exited: see its output for the cause."
        ) from exc
    record.completed = n
    if job is not None:
        job.progress.phase = f"after {call}"
    _forget(store, record.prefix, n - 1, rank)
    if verdict != _OK:
        _refuse(call, rank, json.loads(verdict))


class _Gone:
    """Looks, during an arrival wait, for a missing rank that will never come: its progress
    record says it left distributed() or failed, or its process died (same machine)."""

    def __init__(self, job: Any, store: Any, point: str, rank: int, world: int) -> None:
        self.job, self.store, self.point = job, store, point
        self.rank, self.world = rank, world
        self.started = time.monotonic()

    def look(self) -> None:
        missing = [r for r in range(self.world)
                   if not self.store.check([f"{self.point}/arrived/{r}"])]
        if not missing:
            return
        progress_store, prefix = _barrier.store_and_prefix(self.job)
        records = _progress.read(progress_store, prefix, self.world)
        for r in missing:
            last = records.get(r)
            if last is None:
                continue
            state = last.get("state")
            if state == _progress.LEFT:
                why = f"rank {r} left distributed() at {_progress.describe(last)}"
            elif state == _progress.FAILED:
                why = f"rank {r} failed at {_progress.describe(last)}"
            elif _progress.process_gone(last):
                why = f"rank {r}'s process died (last seen at {_progress.last_seen(last)})"
            else:
                continue
            waited = round(time.monotonic() - self.started, 1)
            self.store.compare_set(f"{self.point}/done", "", json.dumps(
                {"rank": self.rank, "seconds": waited, "missing": missing, "gone": why}))
            return


def _refuse(call: str, rank: int, verdict: dict[str, Any]) -> None:
    if "calls" in verdict:
        raise DistributedError(
            f"rank {rank}: the ranks made different checkpoint calls at once ("
            + ", ".join(f"rank {r} {c}" for r, c in enumerate(verdict["calls"]))
            + "). Every rank must call save_state()/load_state()/save_model() in the same order, "
            "with the same objects under the same names."
        )
    missing, waiter = verdict["missing"], verdict["rank"]
    if "gone" in verdict:
        raise DistributedError(
            f"rank {rank}: {call} must be called on every rank, and {verdict['gone']}: it will "
            f"never arrive, so rank {waiter} stopped waiting after {verdict['seconds']:g} s. "
            "Call it on every rank, before any rank leaves the scope (a loop that ends sooner, "
            "a break or a return on that rank, or the call under `if state().is_main_process:`"
            "): it is collective, and writes (or reads) rank 0's part itself.")
    if rank in missing:
        head = (f"rank {rank} came too late: rank {waiter} waited {verdict['seconds']:g} s for "
                f"rank(s) {missing} and gave up")
    else:
        head = f"rank(s) {missing} never arrived (rank {waiter} waited {verdict['seconds']:g} s)"
    raise DistributedError(
        f"rank {rank}: {call} must be called on every rank; {head}. Call it on every rank, not "
        "under `if state().is_main_process:` or in @on_main_process code: it is collective, "
        "and writes (or reads) rank 0's part itself. If a rank is only slow to get there, set "
        f"{ARRIVAL_ENV} to more seconds (now {arrival_timeout():g})."
    )


def _forget(store: Any, prefix: str, n: int, rank: int) -> None:
    if n < 1:
        return
    with contextlib.suppress(RuntimeError):  # a store without deletion only grows
        store.delete_key(f"{prefix}/{n}/arrived/{rank}")
        if rank == 0:
            store.delete_key(f"{prefix}/{n}/count")
            store.delete_key(f"{prefix}/{n}/done")


# ---- one save per folder -----------------------------------------------------------------------
_held_locks: weakref.WeakSet[FolderLock] = weakref.WeakSet()
_fork_hook = [False]


def _close_in_forked_child() -> None:
    """A forked child drops its copy of every held lock: the lock is its parent's alone, and is
    freed the moment the parent dies (the child's fd would hold it until the child exits)."""
    for lock in list(_held_locks):
        if lock.fd is not None:
            with contextlib.suppress(OSError):
                os.close(lock.fd)
            lock.fd = None
    _held_locks.clear()


class FolderLock:
    """Rank 0's exclusive hold on a checkpoint folder for the time of one save."""

    def __init__(self, root: Path) -> None:
        self.path = root / LOCK
        self.fd: int | None = None

    def acquire(self) -> FolderLock:
        import fcntl

        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise CheckpointError(self._held()) from None
                _warn_unlockable(self.path, exc)
                return self
            try:  # the holder before us may have deleted the file as we opened it: retry
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self.fd = fd
        if not _fork_hook[0]:
            os.register_at_fork(after_in_child=_close_in_forked_child)
            _fork_hook[0] = True
        _held_locks.add(self)
        owner = {"pid": os.getpid(), "host": socket.gethostname(),
                 "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        with contextlib.suppress(OSError):  # only for messages (a full disk is said later)
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps(owner).encode())
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)  # while still holding it: nobody takes a file being deleted
        os.close(self.fd)
        self.fd = None
        _held_locks.discard(self)

    def _held(self) -> str:
        try:
            owner = json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            owner = {}
        who = (f"process {owner.get('pid', '?')} on host {owner.get('host', '?')}, saving since "
               f"{owner.get('since', '?')}") if owner else "a process that has just started"
        return (
            f"save_state: another save into {self.path.parent} is in progress ({who}; it holds "
            f"{self.path}). Two jobs saving into one folder would rotate out and resume each "
            "other's checkpoints: give each job its own folder, or save from one thread at a time."
        )


_unlockable_warned: set[str] = set()


def _warn_unlockable(path: Path, exc: OSError) -> None:
    if str(path.parent) not in _unlockable_warned:
        _unlockable_warned.add(str(path.parent))
        warn_user(
            f"save_state: {path.parent} cannot be locked on this file system ({exc}); saves "
            "proceed unlocked, so two jobs saving into it at once would not be detected.")


# ---- a full disk -------------------------------------------------------------------------------
def explain(exc: BaseException, root: Path, where: str | None = None,
            model_file: bool = False) -> BaseException:
    """A full disk or quota as a CheckpointError naming the folder and the fix; else ``exc``.

    ``model_file``: the error is save_model's, writing the file ``where`` in ``root``.
    """
    if not isinstance(exc, OSError) or exc.errno not in _FULL:
        return exc
    what = "no space left on device" if exc.errno == errno.ENOSPC else "disk quota exceeded"
    target = where or exc.filename or root
    if model_file:
        kept = (f"save_model: {what} while writing {target}. It was left as it was (the new file "
                "is written beside it and renamed into place only once complete).")
    else:
        kept = (f"save_state: {what} while writing {target}. Nothing of this checkpoint was kept "
                f"(its temporary folder is removed) and the previous checkpoints in {root} are "
                "intact.")
    return CheckpointError(
        f"{kept} Free space on that file system, keep fewer checkpoints (keep_last=...), or "
        "save to another folder."
    )
