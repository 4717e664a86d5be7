"""Issue #52, point 3: the rules by which a rank blocked in a collective that can never complete
ends, and whom it names; records in, verdict out (no processes)."""

from __future__ import annotations

import os
from types import SimpleNamespace

from accel_ctx._group import stuck as _stuck
from accel_ctx._job import progress as _progress


def _record(step: int, seq: int, phase: str, state: str = "running", **extra) -> dict:
    return {"step": step, "seq": seq, "phase": phase, "where": "train.py:7 in loop",
            "beat": 3, "pid": os.getpid(), "host": _progress.machine(), "state": state,
            "detail": "", "blames": [], "waiting": False, "blocked": "", "armed": False,
            "raised": "", **extra}


def _watch(world: int, since: float = 0.0) -> _stuck.StuckWatch:
    job = SimpleNamespace(rank=0, world_size=world, progress=_progress.Progress())
    watch = _stuck.StuckWatch(job, beat=None)  # type: ignore[arg-type]
    watch._since = since
    return watch


MINE = _record(3, 1, "forward", blocked="all_gather_single")


def test_a_blocked_rank_waits_out_the_grace_then_names_a_peer_that_failed():
    watch = _watch(2)
    failed = _record(3, 0, "after optimizer step", "failed", detail="ValueError: bad batch")
    records = {0: MINE, 1: failed}
    assert watch._judge(MINE, records, 10.0) is None  # its process may be about to end
    culprits, summary, _ = watch._judge(MINE, records, 10.0 + _stuck.GRACE_S)
    assert culprits == [1]
    assert summary.startswith("rank 1 failed at step 3, after optimizer step (at train.py:7 in "
                              "loop) (ValueError: bad batch) while rank 0 was in step 3, in "
                              "forward"), summary


def test_a_peer_that_gave_up_on_this_rank_names_this_rank():
    watch = _watch(2)
    gave_up = _record(2, 4, "wait_for_everyone()", "failed", blames=[0],
                      detail="rank 0 waits in a collective")
    watch._judge(MINE, {0: MINE, 1: gave_up}, 1.0)
    culprits, summary, _ = watch._judge(MINE, {0: MINE, 1: gave_up}, 1.0 + _stuck.GRACE_S)
    assert culprits == [0] and summary.startswith("rank 1 gave up waiting for this rank")


def test_ranks_blocked_in_the_same_call_are_a_long_collective_not_a_deadlock():
    watch = _watch(3)
    records = {r: dict(MINE) for r in range(3)}
    for now in (1.0, 100.0, 1000.0):
        assert watch._judge(MINE, records, now) is None


def test_ranks_blocked_at_different_calls_name_the_one_building_ddp_once_settled():
    watch = _watch(2, since=0.0)
    mine = _record(2, 1, "forward", blocked="_verify_param_shape_across_processes")
    other = _record(2, 2, "backward", armed=True)
    records = {0: mine, 1: other}
    assert watch._judge(mine, records, 1.0) is None  # the other rank just got there
    culprits, summary, _ = watch._judge(mine, records, 1.0 + _stuck.DEADLOCK_S)
    assert culprits == [0]
    assert summary.startswith("rank 0 builds DDP for a module at step 2, in forward"), summary


def test_a_peer_at_work_is_never_blamed_unless_it_raised_and_went_on():
    watch = _watch(2)
    busy = _record(3, 0, "after optimizer step")  # a long evaluation on rank 1 alone
    for now in (10.0, 1000.0):
        assert watch._judge(MINE, {0: MINE, 1: busy}, now) is None
    caught = dict(busy, raised="ValueError: bad batch, at step 3, in forward")
    assert watch._judge(MINE, {0: MINE, 1: caught}, _stuck.CAUGHT_S / 2) is None
    culprits, summary, _ = watch._judge(MINE, {0: MINE, 1: caught}, _stuck.CAUGHT_S)
    assert culprits == [1]
    assert summary.startswith("rank 1 raised ValueError: bad batch, at step 3, in forward and "
                              "went on without this call"), summary


def test_what_counts_as_blocked_in_a_collective():
    assert _stuck.stuck(_record(1, 1, "forward", blocked="all_gather"))
    assert _stuck.stuck(_record(1, 2, "backward", armed=True))  # DDP's all-reduce in autograd
    assert not _stuck.stuck(_record(1, 2, "backward"))  # a backward nobody else needs
    assert not _stuck.stuck(_record(1, 2, "forward", "failed", blocked="all_gather"))


def test_an_exception_a_rank_caught_is_forgotten_once_it_steps_again():
    progress = _progress.Progress()
    progress.raised = "OutOfMemoryError: CUDA out of memory, at step 0, in forward"
    progress.step = 1  # find_executable_batch_size retried, and the rank trains with the others
    assert progress.raised == ""
