"""state() read outside distributed() in a process started in a replica group warns once,
naming the fix: it answers for a lone process there, so `while state().step < N` never ends."""

from __future__ import annotations

import warnings

import pytest

from accel_ctx import mixed_precision, state
from accel_ctx._scopes import status


def test_state_outside_distributed_in_a_replica_group_warns_once_naming_the_fix(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(status, "_warned_alone", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state()  # not in a replica group: nothing said
    assert not caught
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:1")
    monkeypatch.setenv("REPLICA_GROUP_ID", "1")
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "2")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert state().step == 0
        with mixed_precision("bf16"):  # a scope, but no distributed(): no job either
            state()
        state()
    assert len(caught) == 1, [str(w.message) for w in caught]
    warning = caught[0]
    assert warning.filename == __file__  # the user's line
    text = str(warning.message)
    assert "outside distributed() in a process of replica group 1 of 2" in text
    assert "`while state().step < N` would never end" in text
    assert "Open `with distributed():` around the training loop" in text
