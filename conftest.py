"""Settings for the whole of `python -m pytest`: tests/ and the docstring examples in accel_ctx/.

pyproject.toml collects the package's modules with ``--doctest-modules``; the examples run under
the same autouse fixtures as the tests (device pinned to the CPU, no scope, patch, process group
or environment change left behind), imported from tests/conftest.py so there is one definition.
This file stays outside the package: a conftest inside ``accel_ctx/`` would ship with it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import cpu_unless_gpu_test, no_state_left_behind

__all__ = ["cpu_unless_gpu_test", "no_state_left_behind"]

_TESTS = Path(__file__).resolve().parent / "tests"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fast", action="store_true", help=(
        "the fast tier: only the tests that start no process (tests/_fast.py; ./dev test --fast)"))
    parser.addoption("--record-durations", action="store_true", help=(
        "merge each file's seconds into tests/durations.json, the order the files are handed "
        "out in (tests/_durations.py; ./dev durations)"))
    parser.addoption("--record-cpu", metavar="FILE", help=(
        "count each test file's CPU-seconds (its processes' cgroup) into FILE (tests/_cpu.py)"))


def pytest_ignore_collect(collection_path: Path, config: object) -> bool | None:
    """Under tests/ only test files are collected: ``--doctest-modules`` would otherwise import
    every helper there, the launcher scripts in tests/scripts (which run at import) included."""
    if collection_path.suffix == ".py" and _TESTS in collection_path.parents:
        return not collection_path.name.startswith("test_") or None
    return None
