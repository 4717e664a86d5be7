"""The harness itself: hand-formed reference groups never collide with earlier ones; timeouts
scale with one setting, and a timeout that fires says how loaded the machine was."""

from __future__ import annotations

import subprocess

import pytest

from . import _timeouts
from . import conftest as suite
from ._spawn import WorkerFailed, spawn
from .workers import harness


def test_hand_written_groups_in_a_row_form_even_when_a_peer_closes_late(tmp_path):
    # Each by_hand() group must rendezvous on a file of its own: with one shared path, rank 0's
    # second group read the first group's stale addresses and both ranks hung.
    results = spawn(harness.two_groups_with_a_late_peer, 2, tmp_path, timeout=60)
    assert results == [[0, 0, 0], [1, 1, 1]]


@pytest.fixture
def loaded_machine(monkeypatch):
    """A machine with load average 9 on 2 cores, whatever this one's is."""
    monkeypatch.delenv(_timeouts.ENV, raising=False)
    monkeypatch.setattr(_timeouts, "load", lambda: 9.0)
    monkeypatch.setattr(_timeouts, "cores", lambda: 2)
    monkeypatch.setattr(_timeouts, "_highest", [1.0])  # this session's own stays untouched


def test_every_timeout_scales_with_one_setting_that_reaches_the_ranks(tmp_path, monkeypatch,
                                                                      loaded_machine):
    # half the load per core (the suite's own keeps about two processes per core busy)
    assert _timeouts.factor() == 2.25 and _timeouts.scaled(10) == 22.5
    assert spawn(harness.timeouts_seen, 2, tmp_path) == [(2.25, 22.5)] * 2
    monkeypatch.setattr(_timeouts, "load", lambda: 1.0)
    assert _timeouts.factor() == 2.25  # the highest seen: a bound checked later is never tighter
    monkeypatch.setenv(_timeouts.ENV, "3")  # the setting wins over the load
    assert spawn(harness.timeouts_seen, 1, tmp_path) == [(3.0, 30.0)]
    monkeypatch.setenv(_timeouts.ENV, "0")
    with pytest.raises(ValueError, match="ACCEL_CTX_TEST_TIMEOUT='0': give a positive factor"):
        _timeouts.factor()


def test_a_timeout_that_fires_says_the_machine_is_overloaded(tmp_path, monkeypatch,
                                                             loaded_machine):
    monkeypatch.setenv(_timeouts.ENV, "1")
    advice = ("the machine is overloaded (load average 9.0 on 2 cores): re-run with "
              "ACCEL_CTX_TEST_TIMEOUT=5")
    with pytest.raises(WorkerFailed, match=r"ranks \[0\] sent no result") as info:
        spawn(harness.sleep, 1, tmp_path, 60, timeout=1)
    assert advice in str(info.value)
    # a subprocess's timeout (the launcher's finish(), subprocess.run) fails the test the same way
    wrapper = suite.pytest_pyfunc_call(None)
    next(wrapper)
    with pytest.raises(suite.TimedOut, match="timed out after 5 seconds") as info:
        wrapper.throw(subprocess.TimeoutExpired(["accel-ctx", "launch"], 5))
    assert advice in str(info.value)
