"""The lines a replica group says when the quorum's members change (``replica_events.changes``),
as the launched runs print them: said once, by the lowest group that stayed; one group is "it",
several are "they"; a group that finished is not reported as failed; the samples an absence
skipped. The launched runs (test_replica_groups*.py, test_local_sgd_groups.py) quote them too."""

from __future__ import annotations

from accel_ctx._engines.replica_events import changes


def test_two_groups_that_leave_together_are_they_and_come_back_with_their_shares_counted() -> None:
    left_at: dict[int, int] = {}
    finished: set[int] = set()
    lines = changes(0, frozenset({0, 1, 2}), frozenset({0}), 8, None, left_at, finished, 16)
    assert lines == ["replica groups 1, 2 left at step 8 (they stopped answering the "
                     "lighthouse); 1 group goes on."]
    assert left_at == {1: 8, 2: 8}
    lines = changes(0, frozenset({0}), frozenset({0, 1, 2}), 11, None, left_at, finished, 16)
    assert lines == ["replica groups 1, 2 joined at step 11; 3 groups train. Their shares of "
                     "the 3 steps taken without them were not trained (96 samples)."]
    assert left_at == {}


def test_only_the_lowest_group_that_stayed_says_it_and_a_finished_group_is_not_a_failure(
        ) -> None:
    # group 2 stayed too, but group 0 is the one that speaks
    assert changes(2, frozenset({0, 1, 2}), frozenset({0, 2}), 5, None, {}, set(), 4) == []
    finished = {1}
    assert changes(0, frozenset({0, 1}), frozenset({0}), 5, None, {}, finished, 4) == []
    assert finished == set()  # said once, as it finished
    why = "its part of step 6 failed: Connection closed by peer"
    assert changes(0, frozenset({0, 1}), frozenset({0}), 5, why, {}, set(), None) == [
        f"replica group 1 left at step 5 ({why}); 1 group goes on."]
