"""A failure in rank-only code, or a mismatched collective, ends every rank with an error fast.

Never a hang: each scenario ends on every rank with an error naming the cause, within seconds.
"""

from __future__ import annotations

import functools

import pytest

from .._spawn import outcome, side_by_side, spawn
from .._timeouts import scaled
from ..workers import failures

# seconds, scaled as the workers' timeouts are (a busy machine); the default collective
# timeout is ten minutes
FAST = 15.0


WORLDS = (2, 3)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """Both world sizes at once: their silent ranks' timeouts are waited out side by side."""
    folders = {world: tmp_path_factory.mktemp("fail") for world in WORLDS}
    return side_by_side({world: functools.partial(spawn, failures.run_all, world, folder,
                                                  timeout=180)
                         for world, folder in folders.items()})


@pytest.fixture(scope="module", params=WORLDS, ids=["world2", "world3"])
def ranks(request, worlds):
    return request.param, outcome(worlds[request.param])


def _outcomes(results, name):
    return [res[name] for res in results]


def test_rank_zero_failure_ends_the_others_next_barrier_naming_it(ranks):
    _, results = ranks
    outcomes = _outcomes(results, "uncaught")
    assert outcomes[0][:2] == ("ValueError", "disk full")
    for kind, message, seconds in outcomes[1:]:
        assert kind == "DistributedError"
        assert "rank 0 raised ValueError: disk full in save_report()" in message
        assert "wait_for_everyone()" in message
        assert seconds < scaled(FAST)


def test_failure_is_fatal_even_if_the_failing_rank_catches_it(ranks):
    _, results = ranks
    for kind, message, seconds in _outcomes(results, "caught"):
        assert kind == "DistributedError" and "rank 0 raised ValueError" in message
        assert seconds < scaled(FAST)


def test_main_process_first_failure_releases_the_waiting_ranks(ranks):
    _, results = ranks
    outcomes = _outcomes(results, "main_first")
    assert outcomes[0][:2] == ("OSError", "download failed")
    for kind, message, seconds in outcomes[1:]:
        assert kind == "DistributedError" and "rank 0 raised OSError: download failed" in message
        assert "main_process_first" in message and seconds < scaled(FAST)


def test_with_block_failure_is_announced(ranks):
    _, results = ranks
    outcomes = _outcomes(results, "with_block")
    assert outcomes[0][0] == "RuntimeError"
    for kind, message, seconds in outcomes[1:]:
        assert kind == "DistributedError" and "upload failed" in message and seconds < scaled(FAST)


def test_debug_mode_collective_sees_the_failure(ranks):
    _, results = ranks
    for kind, message, seconds in _outcomes(results, "collective_after_failure")[1:]:
        assert kind == "DistributedError" and "gather()" in message and "disk full" in message
        assert seconds < scaled(FAST)


def test_an_exception_leaving_distributed_is_announced_to_the_others(ranks):
    _, results = ranks
    outcomes = _outcomes(results, "plain_if")
    assert outcomes[0][:2] == ("ValueError", "left the scope")
    for kind, message, seconds in outcomes[1:]:
        assert kind == "DistributedError" and seconds < scaled(FAST)
        assert "rank 0 left distributed() with ValueError: left the scope" in message


def test_a_rank_that_never_arrives_is_named_at_the_timeout(ranks):
    _, results = ranks
    outcomes = _outcomes(results, "silent")
    assert outcomes[0][0] == "ok"
    for kind, message, seconds in outcomes[1:]:
        assert kind == "DistributedError" and "rank(s) [0], which never arrived" in message
        assert 3 < seconds < scaled(4 + FAST)  # at its scaled(4) s timeout


def test_debug_mode_lists_every_rank_shape_on_every_rank(ranks):
    world, results = ranks
    for rank, (kind, message, seconds) in enumerate(_outcomes(results, "shapes")):
        assert kind == "DistributedError" and seconds < scaled(FAST)
        assert f"rank {rank}: gather() stopped by debug mode" in message
        assert "different shapes (only dim 0 may differ)" in message
        for r in range(world):
            assert f"rank {r}: gather() at failures.py:" in message
            assert f"#0 (2, {3 + r}) float32" in message


def test_debug_mode_reports_ranks_in_different_calls(ranks):
    world, results = ranks
    for kind, message, seconds in _outcomes(results, "calls"):
        assert kind == "DistributedError" and "different calls" in message and seconds < scaled(FAST)
        assert "rank 0: reduce(op='sum')" in message
        assert all(f"rank {r}: gather()" in message for r in range(1, world))
    for kind, message, seconds in _outcomes(results, "barrier_vs_collective"):
        assert kind == "DistributedError" and "different calls" in message and seconds < scaled(FAST)
        assert "rank 0: wait_for_everyone()" in message and "reduce(op='max')" in message


def test_debug_mode_lets_fitting_calls_through(ranks):
    _, results = ranks
    assert all(outcome[0] == "ok" for outcome in _outcomes(results, "debug_ok"))


def test_a_rank_whose_process_dies_ends_the_others_wait_at_once_naming_it(tmp_path):
    import pickle

    results = spawn(failures.dead_peer, 3, tmp_path, timeout=120, expect_failure=True)
    assert results[2] == "no result"  # it died
    for payload in results[:2]:
        kind, message, seconds = pickle.loads(payload)
        assert kind == "DistributedError" and "rank 2 died" in message, message
        assert seconds < scaled(15)  # not its scaled(60) s timeout
