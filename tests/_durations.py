"""How long each test file took, recorded by the suite itself, and the order it hands them out in.

`./dev test` runs the files on two pytest-xdist workers (``--dist loadfile``: each file on one
worker, handed out in collection order). The longest go first, so that what is left for the
end, when a worker that is done has nothing more to take, is short (xdist's own order, most
tests first, left the launcher runs for the end). The seconds come from ``tests/durations.json``,
which ``./dev durations`` (``pytest --record-durations``) writes from a run's own reports: each
file's setup, call and teardown times summed. A test file the record does not know yet (a new
one) goes first of all: it may be long, and a long file last makes the long tail this order
exists to avoid. The record is merged, not replaced: a run of some files updates those; a file that
no longer exists is dropped.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

RECORD = Path(__file__).resolve().parent / "durations.json"
OPTION = "--record-durations"


def load(record: Path = RECORD) -> dict[str, float]:
    """The recorded seconds per file (paths relative to the repository root), {} if none."""
    try:
        data = json.loads(record.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in data.items()} if isinstance(data, dict) else {}


def order(files: dict[Path, int], root: Path, record: dict[str, float]) -> list[Path]:
    """``files`` (path: test count) in dispatch order: test files the record lacks first, then
    the recorded ones longest first (a package module's docstring examples, unrecorded, count
    as 0 s); ties by most tests, then by path (the same order on every run)."""
    def key(path: Path) -> tuple[int, float, int, str]:
        name = _name(path, root)
        seconds = record.get(name)
        new = seconds is None and name.startswith("tests/")
        return (0 if new else 1, -(seconds or 0.0), -files[path], name)

    return sorted(files, key=key)


def _name(path: Path, root: Path) -> str:
    try:
        return path.resolve().relative_to(root).as_posix()
    except ValueError:
        return path.as_posix()


class Recorder:
    """The plugin ``--record-durations`` installs on the controlling process: it sums each
    file's reports and merges them into the record at the session's end."""

    def __init__(self, root: Path, record: Path = RECORD) -> None:
        self.root, self.record = root, record
        self.seconds: dict[str, float] = defaultdict(float)
        self.failed = False

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid.split("::", 1)[0]] += report.duration

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if exitstatus not in (0, 1) or not self.seconds:  # interrupted or nothing ran
            return
        merged = {**load(self.record), **self.seconds}
        kept = {name: round(seconds, 1) for name, seconds in sorted(merged.items())
                if (self.root / name).exists()}
        tmp = self.record.with_suffix(".tmp")
        tmp.write_text(json.dumps(kept, indent=1) + "\n")
        tmp.replace(self.record)  # never half-written
