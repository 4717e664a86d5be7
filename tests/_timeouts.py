"""One setting scales every timeout of the test suite: a busy machine makes the tests slower, not red.

``ACCEL_CTX_TEST_TIMEOUT=F`` multiplies every timeout the tests set: the spawn harness's and the
launcher's, the ``distributed(timeout=...)`` the workers open, the subprocesses' and the bounds
that prove a failure ends fast (scaled alike, so the ratio that proves the point stays: "within
15 s, not the 60 s timeout" becomes "within 15F s, not 60F s"). Unset, F follows the machine:
the load average per core beyond the suite's own (which keeps about two processes per core
busy), so half the load per core when that is above 1 (the highest this session has seen, so a
bound checked after a spawn is never tighter than the worker's timeout). The suite alone thus
runs with F = 1: some timeouts are waited out on purpose (a silent rank named at its timeout),
and scaling them would only make it slower. Spawned ranks and launched scripts get the factor
in their environment: the test and its processes use one number.

A timeout that still fires says how loaded the machine was and what to re-run with
(:func:`hint`; tests/conftest.py adds it to any ``subprocess.TimeoutExpired``).
"""

from __future__ import annotations

import math
import os

ENV = "ACCEL_CTX_TEST_TIMEOUT"
_OWN = 2.0  # busy processes per core that the suite itself accounts for
_highest = [1.0]


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        return os.cpu_count() or 1


def load() -> float:
    """The one-minute load average."""
    return os.getloadavg()[0]


def factor() -> float:
    """The factor every timeout is multiplied by (see the module's docstring)."""
    text = os.environ.get(ENV)
    if text:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{ENV}={text!r}: give a positive factor, e.g. {ENV}=4")
        return value
    _highest[0] = max(_highest[0], load() / (_OWN * cores()))
    return _highest[0]


def scaled(seconds: float) -> float:
    """``seconds`` times :func:`factor`."""
    return seconds * factor()


def child_env() -> dict[str, str]:
    """The variable that gives a spawned or launched process this test's factor."""
    return {ENV: repr(factor())}


def hint() -> str:
    """What a fired timeout adds to its failure: the machine's load, and the factor to re-run with."""
    avg, n, now = load(), cores(), factor()
    advice = f"re-run with {ENV}={max(2, math.ceil(2 * max(now, avg / (_OWN * n))))}"
    if avg > _OWN * n:
        return (f"the machine is overloaded (load average {avg:.1f} on {n} cores): {advice} "
                f"(timeouts here were x{now:.3g})")
    return (f"load average {avg:.1f} on {n} cores, timeouts x{now:.3g}: not a busy machine now, "
            f"so likely a real hang; if it was busy, {advice}")
