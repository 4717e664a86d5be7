"""The commit vote of a replica group (issue 53, the per-step cost): a group of one rank takes
its own vote as the group's, without the round trip to its manager server."""

from __future__ import annotations

from typing import Any

from accel_ctx._engines.replica_client import RecordingClient


class ManagerServer:
    """What torchft's manager server answers (src/manager.rs): the AND of the group's votes,
    here of the one rank that asked; each call is a round trip."""

    def __init__(self) -> None:
        self.asked: list[tuple[int, int, bool]] = []

    def should_commit(self, group_rank: int, step: int, should_commit: bool,
                      timeout: Any = None) -> bool:
        self.asked.append((group_rank, step, should_commit))
        return should_commit


def test_a_group_of_one_rank_votes_without_a_round_trip():
    server = ManagerServer()
    client = RecordingClient(server, "accel_ctx_n1_0:5f1e")
    assert client.should_commit(0, 7, True) is True
    assert client.should_commit(0, 8, False) is False  # a failed step is not committed
    assert server.asked == []


def test_a_group_of_several_ranks_asks_its_server_which_waits_for_every_rank():
    server = ManagerServer()
    client = RecordingClient(server, "accel_ctx_n2_1:77aa")
    assert client.should_commit(1, 3, True) is True
    assert server.asked == [(1, 3, True)]
    client = RecordingClient(server, "some_other_id:0")  # the size not said: asked too
    assert client.should_commit(0, 3, False) is False
    assert server.asked[-1] == (0, 3, False)
