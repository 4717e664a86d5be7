"""The suite's own tools: the recorded durations that order `./dev test`, and `./dev flaky`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .. import _durations
from .._timeouts import scaled

ROOT = Path(__file__).resolve().parents[2]


def test_files_are_handed_out_longest_first_and_new_test_files_before_all(tmp_path):
    root = tmp_path
    paths = {name: root / name for name in (
        "tests/a/test_quick.py", "tests/a/test_slow.py", "tests/b/test_new.py",
        "accel_ctx/mod.py", "tests/b/test_mid.py", "tests/b/test_mid_more.py")}
    record = {"tests/a/test_quick.py": 1.0, "tests/a/test_slow.py": 90.0,
              "tests/b/test_mid.py": 20.0, "tests/b/test_mid_more.py": 20.0}
    counts = {path: 1 for path in paths.values()}
    counts[paths["tests/b/test_mid_more.py"]] = 5  # a tie in seconds: most tests first
    ordered = [p.relative_to(root).as_posix() for p in _durations.order(counts, root, record)]
    assert ordered == ["tests/b/test_new.py", "tests/a/test_slow.py", "tests/b/test_mid_more.py",
                       "tests/b/test_mid.py", "tests/a/test_quick.py", "accel_ctx/mod.py"]


def test_the_record_names_only_files_that_exist():
    record = _durations.load()
    assert len(record) > 50  # the suite's files, recorded by ./dev durations
    assert {name for name in record if not (ROOT / name).exists()} == set(), (
        "run ./dev durations and commit tests/durations.json")


def test_a_recording_run_merges_its_seconds_and_keeps_the_others(tmp_path):
    record = tmp_path / "durations.json"
    (tmp_path / "tests").mkdir()
    for name in ("test_a.py", "test_b.py"):
        (tmp_path / "tests" / name).write_text("")
    record.write_text(json.dumps({"tests/test_a.py": 5.0, "tests/test_b.py": 7.0,
                                  "tests/test_gone.py": 3.0}))
    recorder = _durations.Recorder(tmp_path, record)

    class Report:
        def __init__(self, nodeid: str, duration: float) -> None:
            self.nodeid, self.duration = nodeid, duration

    for phase in (0.25, 2.0, 0.25):  # setup, call, teardown
        recorder.pytest_runtest_logreport(Report("tests/test_a.py::test_x", phase))  # type: ignore[arg-type]
    recorder.pytest_sessionfinish(None, 1)  # type: ignore[arg-type]  # a failing run counts too
    assert json.loads(record.read_text()) == {"tests/test_a.py": 2.5, "tests/test_b.py": 7.0}
    recorder.seconds["tests/test_b.py"] = 1.0
    recorder.pytest_sessionfinish(None, 2)  # type: ignore[arg-type]  # interrupted: not written
    assert json.loads(record.read_text())["tests/test_b.py"] == 7.0


@pytest.mark.spawns
def test_flaky_counts_the_rounds_each_file_passed(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_steady.py").write_text("def test_fine():\n    assert True\n")
    # fails in every second round: the count of its runs is kept beside it
    (tests / "test_shaky.py").write_text(
        "from pathlib import Path\n"
        "def test_sometimes():\n"
        "    mark = Path(__file__).with_suffix('.runs')\n"
        "    runs = int(mark.read_text()) + 1 if mark.exists() else 1\n"
        "    mark.write_text(str(runs))\n"
        "    assert runs % 2, runs\n")
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "_flaky.py"), "tests/test_steady.py",
         "tests/test_shaky.py", "-n", "3", "--workers", "0", "-p", "no:randomly"],
        cwd=tmp_path, capture_output=True, text=True, timeout=scaled(120))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "3/3 passed  tests/test_steady.py" in result.stdout, result.stdout
    assert "2/3 passed  tests/test_shaky.py" in result.stdout, result.stdout
    assert "test_sometimes: failed in round(s) 2" in result.stdout, result.stdout
