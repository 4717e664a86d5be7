"""A rendezvous that cannot complete ends in time, with progress lines and its cause (point 9).

Four broken jobs run at once (one spawn, six processes, loopback only): ranks started with
different WORLD_SIZE; MASTER_PORT held by a plain socket server that is no TCPStore; rank 0
alone (rank 1 never starts); rank 1 alone (nothing listens at MASTER_ADDR:MASTER_PORT).
"""

from __future__ import annotations

import socket

import pytest

from .._spawn import free_port, spawn
from .._timeouts import scaled
from ..workers import rendezvous_trust

TIMEOUT = 6.0  # seconds, scaled (a busy machine: the peers of a mismatch must meet in time)


def _env(rank: int, world: int, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "ACCEL_CTX_RDZV_PROGRESS_S": "1"}


@pytest.fixture(scope="module")
def broken_jobs(tmp_path_factory):
    with socket.socket() as held:  # another program on the port: listens, never answers
        held.bind(("127.0.0.1", 0))
        held.listen(8)
        held_port = held.getsockname()[1]
        mismatch, alone, nobody = free_port(), free_port(), free_port()
        envs = [
            _env(0, 2, mismatch), _env(1, 3, mismatch),  # world sizes disagree
            _env(0, 2, held_port), _env(1, 2, held_port),  # port held by another program
            _env(0, 2, alone),  # rank 1 never starts
            _env(1, 2, nobody),  # rank 0 never starts: nothing listens
        ]
        results = spawn(rendezvous_trust.enter, len(envs), tmp_path_factory.mktemp("rdzv"),
                        scaled(TIMEOUT), env=lambda i: envs[i], timeout=150)
    return dict(zip(["mismatch0", "mismatch1", "held0", "held1", "alone0", "nobody1"],
                    results, strict=True))


def _ended_in_time(result):
    assert result["error"] is not None, result
    assert result["elapsed"] < scaled(TIMEOUT + 30), result  # bounded, never the 10-minute default


def test_world_size_mismatch_is_named_on_both_ranks(broken_jobs):
    for name in ("mismatch0", "mismatch1"):
        result = broken_jobs[name]
        _ended_in_time(result)
        assert "RendezvousError" in result["error"], result
        assert "world size mismatch" in result["error"], result
        assert "WORLD_SIZE=2" in result["error"] and "WORLD_SIZE=3" in result["error"], result


def test_port_held_by_another_program_is_named(broken_jobs):
    rank0, rank1 = broken_jobs["held0"], broken_jobs["held1"]
    _ended_in_time(rank0)
    assert "held by another program" in rank0["error"], rank0
    _ended_in_time(rank1)
    assert "held by another program" in rank1["error"], rank1
    assert "not a rendezvous store" in rank1["error"], rank1
    assert len(rank1["progress"]) >= 2, rank1  # it said what it was doing while it waited
    assert all("rank 1 of 2 waiting for the rendezvous at 127.0.0.1:" in line
               for line in rank1["progress"]), rank1


def test_a_rank_that_never_starts_is_named_with_progress_lines(broken_jobs):
    result = broken_jobs["alone0"]
    _ended_in_time(result)
    assert "RendezvousError" in result["error"], result
    assert "1 of 2 processes arrived" in result["error"], result
    assert "rank(s) [1] never arrived" in result["error"], result
    assert len(result["progress"]) >= 2, result
    line = result["progress"][0]
    assert line.startswith("rank 0 of 2 waiting for the rendezvous at 127.0.0.1:"), line
    assert "1 of 2 arrived" in line and line.endswith(" s"), line


def test_nothing_listening_is_named(broken_jobs):
    result = broken_jobs["nobody1"]
    _ended_in_time(result)
    assert "nothing listens at 127.0.0.1:" in result["error"], result
    assert len(result["progress"]) >= 2, result


def test_no_rank_leaves_a_group_before_every_rank_formed_it(tmp_path):
    """A rank that leaves its scope at once (an error before any collective) destroys its side of
    the group; a rank still connecting then failed with gloo's "Connection closed by peer"
    (seen under load as a flaky setup failure). Every rank now waits until all formed it."""
    delay = 1.0
    first, second = spawn(rendezvous_trust.leave_at_once, 2, tmp_path, delay, timeout=120)
    assert len(first["began"]) == len(second["formed"]) == 2
    for began, formed in zip(first["began"], second["formed"], strict=True):
        assert began >= formed - 0.1, (began, formed)  # before: about `delay` earlier
