"""A rank blocked in a collective that will never complete ends there, naming the rank at fault.

A rank inside torch.distributed (an FSDP all-gather, DDP's gradient all-reduce in backward,
DDP's setup in a first forward, a collective of ours) waits for every rank of the group, up to
``distributed(timeout=...)`` (600 s by default), and gloo's wait cannot be interrupted from
another thread: a peer that calls ``abort()`` or leaves the group does not wake it, only the
end of the peer's process does. So a peer that failed and lives on (its exception caught
outside the scope, or inside it), or ranks blocked in collectives that never pair up, held the
job for ten minutes and then named the wrong rank.

The heartbeat thread (``_job.heartbeat``) calls :class:`StuckWatch` after each beat. While the
training thread is blocked at one position it reads the other ranks' records and decides:

1. a peer left ``distributed()`` (failed, or left without an error): it will never join the
   call. After ``GRACE_S`` (the peer's process may be about to end, which ends the wait with
   torch's own error and this rank's traceback) the rank ends, blaming that peer as
   ``_group.blame`` does;
2. a peer raised an exception in its forward or backward, caught it, and works outside the
   collectives for ``CAUGHT_S``: the rank at fault is that one;
3. every peer is blocked as well, at another call, and nobody moved for ``DEADLOCK_S``: the
   collectives never pair up. A rank that is building DDP for a module (its first training
   call, which every rank must make) is the one at fault; otherwise the rank behind the others.

Ending means: this rank's record says "failed" (naming the culprit, so the others and the
launcher agree), the next sync point is marked, the error file names the culprit for ``accel-ctx
launch``, the message goes to stderr and the ``accel_ctx`` logger, and the process exits with
code 1 (the blocked call cannot be made to raise).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from .._job import progress as _progress
from ..errors import DistributedError
from .barrier import announce_failure
from .blame import _culprits, write_error_file

if TYPE_CHECKING:
    from .._job.heartbeat import Heartbeat
    from .._job.job import Job

_log = logging.getLogger("accel_ctx")
LOOK_AFTER_S = 3.0  # blocked this long at one position before the others' records are read
GRACE_S = 5.0  # a peer that left: the time its process has to end (torch then raises)
DEADLOCK_S = 12.0  # every rank blocked at its own call, nobody moving: a deadlock
CAUGHT_S = 20.0  # blocked this long while a peer that raised (and caught it) works elsewhere
EXIT_CODE = 1
# DDP's constructor: the collectives of a model's first training call (every rank must make it)
_DDP_SETUP = ("_verify_param_shape_across_processes", "_sync_module_states",
              "_sync_params_and_buffers", "_broadcast_coalesced")


def stuck(record: dict[str, Any]) -> bool:
    """Whether a published record shows its rank waiting inside torch.distributed: blocked in a
    torch.distributed function, or in a backward whose gradients are averaged across ranks
    (the autograd engine's threads wait there, where no frame of the training thread shows)."""
    return record.get("state") == _progress.RUNNING and bool(
        record.get("blocked") or (record.get("phase") == _progress.BACKWARD
                                  and record.get("armed")))


def _position(record: dict[str, Any]) -> tuple[Any, ...]:
    return (record.get("step"), record.get("seq"), record.get("phase"), record.get("where"),
            record.get("blocked"))


def _kind(record: dict[str, Any]) -> tuple[Any, ...]:
    """The call a rank is blocked in, wherever it was made from."""
    return record.get("step"), record.get("phase"), record.get("blocked")


class StuckWatch:
    """Run by the heartbeat thread after each beat (see the module's docstring)."""

    def __init__(self, job: Job, beat: Heartbeat) -> None:
        self.job, self.beat = job, beat
        self._position: tuple[Any, ...] | None = None
        self._since = 0.0
        self._left_seen: float | None = None  # when a peer that left was first seen
        self._peers: dict[int, tuple[tuple[Any, ...], float]] = {}  # position, since when

    def __call__(self, record: dict[str, Any]) -> None:
        now = time.monotonic()
        if not stuck(record) or self.job.progress.state != _progress.RUNNING:
            self._position, self._left_seen = None, None
            return
        position = _position(record)
        if position != self._position:
            self._position, self._since, self._left_seen = position, now, None
            self._peers.clear()
            return
        if now - self._since < LOOK_AFTER_S:
            return
        others = self.beat.others()
        others[self.job.rank] = record
        verdict = self._judge(record, others, now)
        if verdict is not None:
            end(self.job, self.beat, record, *verdict)

    def _judge(self, mine: dict[str, Any], records: dict[int, dict[str, Any]], now: float
               ) -> tuple[list[int], str, str] | None:
        me = self.job.rank
        peers = {r: rec for r, rec in records.items() if r != me}
        doing = _doing(mine)
        if any(rec.get("state") in (_progress.FAILED, _progress.LEFT) for rec in peers.values()):
            if self._left_seen is None:
                self._left_seen = now
            if now - self._left_seen < GRACE_S:
                return None
            return _culprits(records, me, self.job.progress, doing, True)
        self._left_seen = None
        caught = sorted(r for r, rec in peers.items() if rec.get("raised") and not stuck(rec)
                        and not rec.get("waiting") and rec.get("state") == _progress.RUNNING)
        if caught and now - self._since >= CAUGHT_S:
            r = caught[0]
            return [r], (
                f"rank {r} raised {peers[r]['raised']} and went on without this call (it is at "
                f"{_progress.describe(peers[r])}), while rank {me} waits for it at {doing}"
            ), (
                f"The script caught rank {r}'s exception and carried on, so that rank skipped "
                "collectives the others make (a sharded or DDP model's forward and backward "
                "are collectives). Let the exception end the scope, or make every rank skip "
                "the same work together."
            )
        if len(peers) < self.job.world_size - 1 or not all(stuck(r) for r in peers.values()):
            self._peers.clear()
            return None
        for r, rec in peers.items():
            seen = self._peers.get(r)
            if seen is None or seen[0] != _position(rec):
                self._peers[r] = (_position(rec), now)
        if all(_kind(rec) == _kind(mine) for rec in peers.values()):
            return None  # the same call everywhere (maybe from other lines): a long one
        if now - max(self._since, *(s for _, s in self._peers.values())) < DEADLOCK_S:
            return None  # someone moved lately
        return deadlock(records, me)


def _doing(record: dict[str, Any]) -> str:
    blocked = record.get("blocked")
    inside = f", inside torch.distributed's {blocked}()" if blocked else ""
    return f"{_progress.describe(record)}{inside}"


def deadlock(records: dict[int, dict[str, Any]], me: int) -> tuple[list[int], str, str]:
    """The verdict on ranks blocked in collectives that do not pair up (``records``: every
    rank's, this one's included)."""
    listing = "; ".join(f"rank {r}: {_doing(rec)}" for r, rec in sorted(records.items()))
    setting_up = sorted(r for r, rec in records.items()
                        if rec.get("phase") == _progress.FORWARD
                        and rec.get("blocked") in _DDP_SETUP)
    if setting_up and len(setting_up) < len(records):
        r = setting_up[0]
        others = sorted(set(records) - set(setting_up))
        return setting_up, (
            f"rank {r} builds DDP for a module at {_progress.describe(records[r])}: that is "
            f"the module's first call with gradients, which every rank must make together, and "
            f"rank(s) {others} did not make it (they went on: {listing})"
        ), (
            "Call each model in training on every rank (a module first called under `if rank == "
            "0:` or in a branch taken on some ranks only never gets the others' DDP): call it "
            "on every rank, or under torch.no_grad() where one rank alone needs it."
        )
    lowest = min(records, key=lambda r: (int(records[r].get("step", 0)),
                                         int(records[r].get("seq", 0)), r))
    return [lowest], (
        f"the ranks wait in collectives that do not pair up ({listing}), and none has moved "
        f"for {DEADLOCK_S:g} s; rank {lowest} is the furthest behind"
    ), (
        "Every rank must make the same sequence of collective calls (a model's forward and "
        "backward under DDP or sharded() are collectives too): look for one under `if rank == "
        "0:` or in a loop that runs a different number of times on some ranks."
    )


def end(job: Job, beat: Heartbeat, mine: dict[str, Any], culprits: list[int], summary: str,
        advice: str) -> None:
    """Mark this rank failed naming ``culprits``, say why, and end the process."""
    me = job.rank
    text = (
        f"rank {me}: {summary}. {advice} Rank {me} was blocked at {_doing(mine)}, a call "
        "that cannot complete and cannot be interrupted, so its process ends here (exit code "
        f"{EXIT_CODE}) instead of waiting out distributed(timeout=...)."
    )
    progress = job.progress
    progress.state, progress.detail, progress.blames = _progress.FAILED, summary, culprits
    beat.publish(dist.distributed_c10d._get_default_store())
    announce_failure(job, summary, "blame" if culprits[:1] != [me] else "failed",
                     culprits[0] if culprits else None)
    error = DistributedError(text)
    if culprits:
        write_error_file(error, culprits[0], error)
    try:
        _log.error("DistributedError: %s", text)  # without a handler: on stderr
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(EXIT_CODE)
