"""Sync points through the rendezvous store: barriers that know when a peer has failed.

``dist.barrier()`` waits for a peer that failed in code only it ran (an ``@on_main_process``
function, the first half of ``main_process_first()``) until the timeout, ten minutes by default.
These barriers are made of store keys instead: the failing rank marks the next sync point as
failed, and every rank waiting there (or arriving later) raises at once, naming it. In debug
mode the same points carry each rank's description of a collective, compared before torch runs.

The n-th sync point of a process group (every rank counts its own; all run the same program):

* rank r writes ``n/arrived/r`` (what it waits in), then adds 1 to ``n/count``; the rank that
  brings the count to the world size writes ``n/done = "ok"``;
* a failing rank writes ``n/done = "failed: <rank>|..."`` for the point it would join next, a
  rank leaving ``distributed()`` without an error ``n/done = "left: <rank>|..."``, a rank that
  gave up on another ``"blame: <that rank>|..."`` (``compare_set``: the first one wins, and a
  completed point cannot be overwritten);
* every rank waits for ``n/done`` and reads it.

Keys of point n-1 are deleted once point n completes: by then every rank has posted at n, so
nobody reads n-1 any more.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch._C._distributed_c10d import Store

from . import _progress
from .errors import DistributedError

if TYPE_CHECKING:
    from ._job import Job

_WATCH_S = 1.0  # how often a waiting rank looks whether a missing rank's process died
_OK = "ok"
_FAILED = "failed: "
_LEFT = "left: "
_BLAME = "blame: "


class _SyncRecord:
    """Sync-point bookkeeping of one process group (one root ``Job``)."""

    __slots__ = ("completed", "pending", "prefix", "store")

    def __init__(self, prefix: str, store: Store) -> None:
        self.prefix = prefix
        self.store = store
        self.completed = 0  # sync points passed
        self.pending = 0  # the point being waited at (0: none)


# Keyed by the root job: nested distributed() scopes share their outer scope's group.
_records: weakref.WeakKeyDictionary[Job, _SyncRecord] = (
    weakref.WeakKeyDictionary()
)
# A process group the user formed outside accel_ctx is reused by later scopes with the same
# store, so each scope counts its points under a prefix of its own. Every rank opens the same
# scopes in the same order, so the numbers agree without talking.
_generations = itertools.count(1)
_lock = threading.Lock()


def _record(job: Job) -> _SyncRecord:
    base = job.root
    with _lock:
        record = _records.get(base)
        if record is None:
            store = dist.distributed_c10d._get_default_store()
            record = _records[base] = _SyncRecord(f"accel_ctx/sync/{next(_generations)}", store)
        return record


def store_and_prefix(job: Job) -> tuple[Store, str]:
    """The store and key prefix of ``job``'s process group (progress records live there)."""
    record = _record(job)
    return record.store, record.prefix


def sync_point(
    job: Job, label: str, signature: str | None = None, read: bool = False
) -> list[str]:
    """Wait until every rank reaches its matching sync point.

    ``label`` names the call for messages ("wait_for_everyone()"); ``signature`` is what this
    rank says about it (defaults to the label). ``read=True`` returns every rank's signature, in
    rank order, for the caller to compare (debug mode); otherwise an empty list.
    """
    record = _record(job)
    store, rank, world = record.store, job.rank, job.world_size
    n = record.completed + 1
    record.pending = n
    point = f"{record.prefix}/{n}"
    timeout = job.options.timeout
    job.progress.enter(label)
    try:
        store.set(f"{point}/arrived/{rank}", signature if signature is not None else label)
        if store.add(f"{point}/count", 1) == world:
            store.compare_set(f"{point}/done", "", _OK)
        _wait_watching(job, record, point, label, timeout.total_seconds())
        verdict = store.get(f"{point}/done").decode()
        if verdict != _OK:
            raise _refused(rank, label, verdict)
        signatures = [] if not read else [
            v.decode() for v in store.multi_get([f"{point}/arrived/{r}" for r in range(world)])
        ]
    except RuntimeError as exc:
        if isinstance(exc, DistributedError):
            raise
        # A timeout, or the store's host (rank 0 with a TCP store) went away.
        text, missing = _stalled(job, record, point, label, timeout.total_seconds(), exc)
        error = DistributedError(text)
        error.culprit = missing[0] if missing else None  # type: ignore[attr-defined]
        raise error from exc
    finally:
        record.pending = 0
    record.completed = n
    job.progress.phase = f"after {label}"
    _forget(record, n - 1, rank)
    return signatures


def _wait_watching(job: Job, record: _SyncRecord, point: str, label: str,
                   seconds: float) -> None:
    """Wait for the point's verdict; a missing rank whose process died (on this machine) ends
    the wait at once, marked for every rank, instead of at the timeout."""
    deadline = time.monotonic() + seconds
    done = f"{point}/done"
    while True:
        left = deadline - time.monotonic()
        try:
            record.store.wait([done], timedelta(seconds=max(0.01, min(_WATCH_S, left))))
            return
        except RuntimeError as exc:
            if left <= _WATCH_S or "timeout" not in str(exc).lower():
                raise
        dead = _dead(job, record, point)
        if dead is not None:
            rank, where = dead
            announce_failure(job, f"rank {rank} died{f' ({where})' if where else ''}",
                             culprit=rank)
            return  # the verdict names the dead rank


def _dead(job: Job, record: _SyncRecord, point: str) -> tuple[int, str] | None:
    """A rank that has not arrived and whose process is gone, with where it last was."""
    missing = [r for r in range(job.world_size)
               if not record.store.check([f"{point}/arrived/{r}"])]
    if not missing:
        return None
    records = _progress.read(record.store, record.prefix, job.world_size)
    for rank in missing:
        last = records.get(rank)
        if last is not None and last.get("state") == _progress.RUNNING and (
                _progress.process_gone(last)):
            return rank, _progress.describe(last)
    return None


def _refused(rank: int, label: str, verdict: str) -> DistributedError:
    """The error for a sync point another rank marked (``<kind>: <culprit>|<what>``)."""
    kind = next((k for k in (_LEFT, _BLAME, _FAILED) if verdict.startswith(k)), _FAILED)
    culprit, _, what = verdict[len(kind):].partition("|")
    because = f"rank {rank}: {label} cannot complete because {what}"
    if kind == _LEFT:
        text = (
            f"{because}: that rank will never arrive, so this rank stops here instead of "
            "waiting for it. Every rank must make the same wait_for_everyone()/collective calls "
            "until the scope ends: look for a loop that ends sooner, a break or a return on "
            "that rank."
        )
    elif kind == _BLAME:
        text = (
            f"{because}. This rank stops here instead of waiting; see the output of the rank "
            "named for the cause."
        )
    else:
        text = (
            f"{because}. This rank stops here instead of waiting for it; see that rank's "
            "traceback for the cause. A failure in rank-only code ends the job even if that "
            "rank catches it: handle recoverable errors inside the function."
        )
    error = DistributedError(text)
    error.culprit = int(culprit) if culprit.isdigit() else None  # type: ignore[attr-defined]
    return error


def _stalled(
    job: Job, record: _SyncRecord, point: str, label: str, seconds: float,
    exc: BaseException,
) -> tuple[str, list[int]]:
    rank, world = job.rank, job.world_size
    try:
        missing = [
            r for r in range(world) if not record.store.check([f"{point}/arrived/{r}"])
        ]
    except RuntimeError:
        return (
            f"rank {rank}: {label} lost the rendezvous store ({exc}). The rank hosting it (rank "
            "0 with a TCP store) has most likely exited: see its output for the cause."
        ), []
    where = whereabouts(job, missing)
    return (
        f"rank {rank}: {label} waited {seconds:g} s for rank(s) {missing}, which never arrived "
        f"({exc}){f'; {where}' if where else ''}. They are stuck, dead, or skipped this call: "
        "every rank must make the same sequence of wait_for_everyone()/collective calls. See "
        "their output; raise distributed(timeout=...) if they are only slow."
    ), missing


def _forget(record: _SyncRecord, n: int, rank: int) -> None:
    if n < 1:
        return
    point = f"{record.prefix}/{n}"
    with contextlib.suppress(RuntimeError):  # a store without deletion only grows
        record.store.delete_key(f"{point}/arrived/{rank}")
        if rank == 0:
            record.store.delete_key(f"{point}/count")
            record.store.delete_key(f"{point}/done")


def announce_failure(job: Job, what: str, kind: str = "failed",
                     culprit: int | None = None) -> None:
    """Mark the next sync point failed: the ranks waiting there raise, naming ``what``.

    ``kind``: "failed" (an exception), "left" (this rank leaves ``distributed()`` without an
    error; ``what`` says where) or "blame" (``what`` names another rank that stopped answering).
    ``culprit``: the rank to blame (default: this one), for the launchers' summaries.
    Called while an exception propagates, so it never raises itself.
    """
    if job.world_size == 1:
        return
    with contextlib.suppress(Exception):
        record = _record(job)
        n = record.pending or record.completed + 1
        prefix = {"left": _LEFT, "blame": _BLAME}.get(kind, _FAILED)
        rank = job.rank if culprit is None else culprit
        record.store.compare_set(f"{record.prefix}/{n}/done", "", f"{prefix}{rank}|{what}")


def whereabouts(job: Job, ranks: list[int]) -> str:
    """Where the given ranks last reported to be, for a barrier's timeout message ('' if none)."""
    with contextlib.suppress(Exception):
        store, prefix = store_and_prefix(job)
        records = _progress.read(store, prefix, job.world_size)
        parts = []
        for r in ranks:
            rec = records.get(r)
            if rec is None:
                continue
            state = rec.get("state")
            if state == _progress.LEFT:
                parts.append(f"rank {r} left distributed() at {_progress.describe(rec)}")
            elif _progress.process_gone(rec):
                parts.append(f"rank {r}'s process died (last seen at {_progress.describe(rec)})")
            else:
                parts.append(f"rank {r} is at {_progress.describe(rec)}")
        return "; ".join(parts)
    return ""
