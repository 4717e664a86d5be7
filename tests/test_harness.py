"""The harness itself: hand-formed reference groups never collide with earlier ones."""

from __future__ import annotations

from ._spawn import spawn
from .workers import harness


def test_hand_written_groups_in_a_row_form_even_when_a_peer_closes_late(tmp_path):
    # Each by_hand() group must rendezvous on a file of its own: with one shared path, rank 0's
    # second group read the first group's stale addresses and both ranks hung.
    results = spawn(harness.two_groups_with_a_late_peer, 2, tmp_path, timeout=60)
    assert results == [[0, 0, 0], [1, 1, 1]]
