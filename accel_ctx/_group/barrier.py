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
import weakref
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch._C._distributed_c10d import Store

from .._job import progress as _progress
from ..errors import DistributedError
from .keywait import KeyWait

if TYPE_CHECKING:
    from .._job.job import Job

_WATCH_S = 1.0  # how often a waiting rank looks whether a missing rank will ever come
_STUCK_LOOKS = 3  # fresh records showing a missing rank blocked in a collective, to name it
_OK = "ok"
_FAILED = "failed: "
_LEFT = "left: "
_BLAME = "blame: "


class _SyncRecord:
    """Sync-point bookkeeping of one process group (one root ``Job``)."""

    __slots__ = ("completed", "pending", "prefix", "store", "waits")

    def __init__(self, prefix: str, store: Store) -> None:
        self.prefix = prefix
        self.store = store
        self.waits = KeyWait(store)
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
    """Wait for the point's verdict; a missing rank that will never arrive ends the wait at
    once, marked for every rank, instead of at the timeout: its process died (on this machine),
    or it waits in a collective, which needs this rank (see :class:`Watch`)."""
    watch = Watch(job, label)

    def look() -> None:
        missing = [r for r in range(job.world_size)
                   if not record.store.check([f"{point}/arrived/{r}"])]
        found = watch.never_arriving(missing)
        if found is not None:  # the verdict names that rank, and ends the wait
            rank, what = found
            announce_failure(job, what, "failed" if watch.died else "blame", culprit=rank)

    record.waits.wait(f"{point}/done", seconds, look, look_interval(job.world_size))


def look_interval(world: int) -> float:
    """Seconds between two looks at the other ranks' records during a wait: each look reads
    every rank's, so large jobs look less often."""
    return _WATCH_S * max(1.0, world / 32)


class Watch:
    """Looks, about once a second during a wait of ours, for a missing rank that will never
    come: its process died (same machine), or its records show it blocked in a collective
    (inside torch.distributed, at one position, over ``_STUCK_LOOKS`` fresh records), which can
    only complete once this rank joins it, while this rank waits for it here."""

    def __init__(self, job: Job, label: str) -> None:
        self.job, self.label = job, label
        self.died = False
        self._seen: dict[int, tuple[tuple[Any, ...], Any, int]] = {}

    def never_arriving(self, missing: list[int]) -> tuple[int, str] | None:
        """(that rank, what to tell the others) or None."""
        if not missing:
            return None
        store, prefix = store_and_prefix(self.job)
        records = _progress.read(store, prefix, self.job.world_size)
        for rank in missing:
            last = records.get(rank)
            if last is not None and last.get("state") == _progress.RUNNING and (
                    _progress.process_gone(last)):
                self.died = True
                return rank, f"rank {rank} died (last seen at {_progress.last_seen(last)})"
        for rank in missing:
            last = records.get(rank) or {}
            if last.get("state") != _progress.RUNNING or not last.get("blocked"):
                self._seen.pop(rank, None)
                continue
            key = (last.get("step"), last.get("seq"), last.get("phase"), last.get("blocked"))
            seen = self._seen.get(rank)
            if seen is None or seen[0] != key:
                self._seen[rank] = (key, last.get("beat"), 1)
            elif seen[1] != last.get("beat"):  # a fresh record, still there
                self._seen[rank] = (key, last.get("beat"), seen[2] + 1)
                if seen[2] + 1 >= _STUCK_LOOKS:
                    return rank, self._deadlock(rank, last)
        return None

    def _deadlock(self, rank: int, last: dict[str, Any]) -> str:
        me = self.job.rank
        where = self.job.progress.where
        return (
            f"rank {rank} waits in a collective at {_progress.describe(last)} (inside "
            f"torch.distributed's {last.get('blocked')}()), which needs every rank, while rank "
            f"{me} waits in {self.label}{f' (at {where})' if where else ''}: neither can go on. "
            f"Rank {rank} runs code the other ranks skip (a sharded model's forward, or a "
            "collective, under `if rank == 0:` or in a loop that runs more often on that "
            "rank): make that call on every rank, or keep collectives out of code one rank "
            "runs alone (@on_main_process refuses them at once)"
        )


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
                parts.append(f"rank {r}'s process died (last seen at {_progress.last_seen(rec)})")
            else:
                parts.append(f"rank {r} is at {_progress.describe(rec)}")
        return "; ".join(parts)
    return ""
