"""The right rank is named, fast: a stalled or departed rank, and collectives in rank-only code.

A rank that stalls is named by the others when the gloo timeout (distributed(timeout=...))
fires, with its step and phase; a rank that leaves distributed() early is named at once, in a
backward, a barrier or a debug-mode check; collective calls inside @on_main_process & co. or
main_process_first() raise at once instead of hanging. The launchers blame the same rank.
"""

from __future__ import annotations

import functools
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from accel_ctx import launch
from accel_ctx.errors import DistributedError

from .._spawn import outcome, side_by_side, spawn
from .._timeouts import child_env, scaled
from ..workers import blame_trust
from ..workers.blame_trust import LONG, STALL_TIMEOUT

AT_ONCE = 45.0  # seconds (scaled where checked), scope set-up included: far below LONG
ROOT = Path(__file__).resolve().parents[2]
ACCEL_CTX = str(Path(sys.executable).with_name("accel-ctx"))


WORLDS = (2, 3)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """Both world sizes at once: their stalled ranks wait out the gloo timeout side by side."""
    folders = {world: tmp_path_factory.mktemp("blame") for world in WORLDS}
    return side_by_side({world: functools.partial(spawn, blame_trust.run_all, world, folder,
                                                  str(folder), timeout=300)
                         for world, folder in folders.items()})


@pytest.fixture(scope="module", params=WORLDS, ids=["world2", "world3"])
def ranks(request, worlds):
    return request.param, outcome(worlds[request.param])


def _outcomes(results, name):
    return [res[name] for res in results]


def test_a_stalled_rank_is_named_with_its_step_and_phase(ranks):
    _, results = ranks
    for rank, (kind, message, culprit, seconds) in enumerate(_outcomes(results, "stall")):
        assert kind == "DistributedError", (rank, kind, message)
        assert culprit == 1
        if rank == 1:  # the stalled rank learns it was the one given up on
            assert "gave up waiting for this rank" in message
        else:  # the gloo timeout that applies is distributed(timeout=...), not ten minutes
            assert seconds < scaled(STALL_TIMEOUT + AT_ONCE)
        assert "rank 1 stopped answering at step 3, in forward" in message
        assert "in _wait_for_flag" in message  # the line it was stuck on
        assert "waiting for it in backward" in message or "connection to it in backward" in (
            message)


def test_a_rank_stalled_inside_save_state_is_named_by_the_ranks_that_waited(ranks):
    # it stands at the others' step and call, so no rank was behind: the message blamed no
    # one and told of a mismatch of collectives that did not exist
    _, results = ranks
    for rank, (kind, message, culprit, seconds) in enumerate(
            _outcomes(results, "stall_in_save")):
        assert kind == "DistributedError", (rank, kind, message)
        assert culprit == 1, (rank, message)
        if rank == 1:
            assert "gave up waiting for this rank" in message
        else:
            assert "rank(s) [1] never came to the call: busy outside any collective" in message
            assert "in _wait_for_flag" in message  # the line it was stuck on
            assert seconds < scaled(STALL_TIMEOUT + AT_ONCE)


def test_a_rank_leaving_early_is_named_at_once_in_backward(ranks):
    _, results = ranks
    for rank, (kind, message, culprit, seconds) in enumerate(_outcomes(results, "leave_backward")):
        if rank == 1:
            assert kind == "ok"
            continue
        assert kind == "DistributedError", (rank, message)
        assert "rank 1 left distributed() at step 3" in message
        assert culprit == 1 and seconds < scaled(AT_ONCE) and AT_ONCE < LONG


def test_a_rank_leaving_early_ends_the_others_barrier_and_debug_check_at_once(ranks):
    _, results = ranks
    for name, call in (("leave_barrier", "wait_for_everyone()"), ("leave_debug", "gather()")):
        for rank, (kind, message, culprit, seconds) in enumerate(_outcomes(results, name)):
            if rank == 1:
                assert kind == "ok"
                continue
            assert kind == "DistributedError" and culprit == 1, (name, rank, message)
            assert f"rank {rank}: {call} cannot complete because rank 1 left distributed()" in (
                message)
            assert seconds < scaled(AT_ONCE)
    barrier = _outcomes(results, "leave_barrier")[0][1]
    assert "at step 2, after optimizer step" in barrier


def test_collectives_inside_rank_only_code_raise_at_once(ranks):
    world, results = ranks
    if world != 2:
        pytest.skip("run once, on two ranks")
    calls = results[0]["rank_only"]
    for name in ("gather", "reduce", "wait_for_everyone", "save_state", "load_state",
                 "save_model"):
        kind, message, _, seconds = calls[name]
        assert kind == "DistributedError", (name, message)
        assert f"{name}() called inside @on_main_process (in " in message
        assert "only rank 0 runs it" in message and "Move the call out" in message
        assert seconds < scaled(AT_ONCE)
    for name in ("train_step", "backward"):  # a backward DDP would average across ranks
        kind, message, _, _ = calls[name]
        assert kind == "DistributedError" and "backward() called inside @on_main_process" in (
            message), (name, message)
    assert calls["preview"][0] == "ok" and calls["eval"][0] == "ok"  # no backward: allowed
    kind, message, _, _ = calls["local"]
    assert kind == "DistributedError"
    assert "gather() called inside @on_local_main_process" in message
    kind, message, _, _ = results[1]["rank_only"]["rank1"]
    assert kind == "DistributedError"
    assert "reduce() called inside @on_process(1)" in message and "only rank 1 runs it" in message
    for kind, message, _, _ in _outcomes(results, "rank_only_end"):  # announced to every rank
        assert kind == "DistributedError"
        assert "rank 0 raised DistributedError: gather() called inside" in message


def test_a_collective_inside_main_process_first_raises_and_releases_the_others(ranks):
    world, results = ranks
    if world != 2:
        pytest.skip("run once, on two ranks")
    (kind0, message0, _, _), (kind1, message1, _, seconds1) = _outcomes(results, "main_first")
    assert kind0 == "DistributedError"
    assert "gather() called inside main_process_first()" in message0
    assert "rank 0 runs the block while the other ranks wait" in message0
    assert kind1 == "DistributedError" and "rank 0 raised DistributedError" in message1
    assert seconds1 < scaled(AT_ONCE)


def test_a_rank_whose_process_dies_is_named_by_every_other_rank(tmp_path):
    results = spawn(blame_trust.rank_dies, 3, tmp_path, timeout=120, expect_failure=True)
    assert results[1] == "no result"  # os._exit: it sent nothing
    for rank in (0, 2):
        kind, message, culprit, seconds = pickle.loads(results[rank])
        assert kind == "DistributedError", (rank, message)
        assert "rank 1's process died (last seen at step" in message, message
        assert culprit == 1 and seconds < scaled(LONG)


def test_launch_fn_names_the_stalled_rank(tmp_path):
    with pytest.raises(DistributedError) as info:
        launch(blame_trust.launched_stall, nprocs=2, args=(str(tmp_path),),
               timeout=scaled(120))
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "rank 1 stopped answering at step 3, in forward" in str(info.value)
    assert "launch(): rank 1 of 2 caused this failure (named by rank 0" in notes


def test_accel_ctx_launch_names_the_rank_that_left(tmp_path):
    (tmp_path / ".git").mkdir()  # a project root: no config file from above
    script = ROOT / "tests" / "scripts" / "leave_early.py"
    env = {**os.environ, **child_env(), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [ACCEL_CTX, "launch", "-n", "2", str(script)], cwd=tmp_path, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=scaled(150))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = output.decode(errors="replace")
    assert proc.returncode != 0, text
    assert "accel-ctx launch: rank 1 caused the failure (named by rank 0" in text, text
    assert "rank 1 left distributed() at step 3" in text, text


def test_a_rank_stalled_under_tensor_parallelism_ends_every_rank_within_the_timeout(tmp_path):
    # sharded(tp=2) on 4 ranks: the tp and dp collectives run on a 2-D mesh's subgroups, which
    # torch makes with its own default timeout (30 minutes on gloo) unless told the job's. (Which
    # rank is named is not asserted: a rank waiting in a tp collective torch completes lazily,
    # outside the forward, can time out and leave first, and is then named; not fixed yet.)
    results = spawn(blame_trust.stalled_on_a_mesh, 4, tmp_path, str(tmp_path), timeout=300)
    for rank, (kind, message, _, seconds) in enumerate(results):
        assert kind != "ok", (rank, message)
        if rank != 1:
            assert seconds < scaled(STALL_TIMEOUT + AT_ONCE), (rank, seconds, message)
