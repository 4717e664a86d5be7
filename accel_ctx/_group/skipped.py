"""An optimizer step with no backward since a synchronised forward, on one rank: named there.

Under ``distributed()`` (DDP) and ``sharded()`` (FSDP2) every rank's backward meets the others'
in a collective (the gradient all-reduce, the reduce-scatter). A rank that skips
``loss.backward()`` but still calls ``opt.step()`` leaves the others waiting in their backward;
its own next backward then pairs with theirs of this step, and from there on its gradients are
averaged one step off, silently, until the ranks' calls stop fitting together (a ``gather()``
timing out at the end of the job). This is the only place it can be told: at that step.

The progress record (``_job.progress``) calls :class:`UnsyncedSteps` when a step comes while
the rank is *armed* (a forward that every rank's backward must follow ran, and no backward
since): rare, off the hot path. It reads the other ranks' records for a few heartbeats: a rank
in its backward at this step is waiting for this one, and this rank raises
:class:`DistributedError` naming the skipped backward. Ranks that all step after such a forward
(a forward kept for logging before the step, say) clear the check for the rest of the job.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .._job import progress as _progress
from ..errors import DistributedError

if TYPE_CHECKING:
    from .._job.heartbeat import Heartbeat
    from .._job.job import Job

LOOK_S = 3.0 * _progress.INTERVAL_S  # at most this long: the others' records are a beat old


class UnsyncedSteps:
    """Called with the step (``Progress.on_unsynced_step``) on the training thread."""

    def __init__(self, job: Job, beat: Heartbeat) -> None:
        self.job, self.beat = job, beat
        self.cleared = False  # this script steps after such forwards on every rank

    def __call__(self, step: int) -> None:
        if self.cleared:
            return
        me = self.job.rank
        deadline = time.monotonic() + LOOK_S
        while True:
            peers = {r: rec for r, rec in self.beat.others().items() if r != me}
            waiting = sorted(r for r, rec in peers.items()
                             if rec.get("state") == _progress.RUNNING
                             and int(rec.get("step", -1)) == step
                             and rec.get("phase") == _progress.BACKWARD)
            if waiting:
                raise _skipped(me, step, waiting, peers)
            if len(peers) == self.job.world_size - 1 and all(
                    int(rec.get("step", -1)) > step for rec in peers.values()):
                self.cleared = True  # every rank stepped without waiting here: by design
                return
            if time.monotonic() >= deadline:
                return
            time.sleep(0.2)


def _skipped(me: int, step: int, waiting: list[int],
             peers: dict[int, dict[str, object]]) -> DistributedError:
    where = _progress.here()
    r = waiting[0]
    error = DistributedError(
        f"rank {me} called opt.step() at step {step}{f' (at {where})' if where else ''} with no "
        f"loss.backward() since its forward, while rank(s) {waiting} ran their backward of "
        f"this step (rank {r} at {_progress.describe(dict(peers[r]))}): every rank's backward "
        "averages the gradients with the other ranks', so rank "
        f"{me}'s next backward would be averaged with their backward of this step (one step "
        f"off, silently) and rank(s) {waiting} wait for it meanwhile. Call loss.backward() on "
        "every rank at every step; to skip a batch, skip it on every rank together (decide with "
        "any_rank(skip): True on every rank if any rank skips)."
    )
    error.culprit = me  # type: ignore[attr-defined]
    return error
