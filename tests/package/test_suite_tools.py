"""The suite's own tools: the recorded durations that order `./dev test`, `./dev flaky`, the
CPU-seconds count (`--record-cpu`) and the forked scripts of tests/_zygote.py."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .. import _cpu, _durations, _zygote
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


_BURN = "import time\nend = time.process_time() + 1.0\nwhile time.process_time() < end:\n    pass\n"


@pytest.mark.skipif(not ((tree := _cpu.tree()) and os.access(tree, os.W_OK)),
                    reason="--record-cpu needs write access to a cgroup tree")
def test_the_cpu_count_holds_what_a_process_starts_after_it_joined(tmp_path):
    # a child that burns 1 CPU-second, started after the group was joined, counts in it
    group = f"accel-ctx-tests-probe-{os.getpid()}"
    code = (f"import subprocess, sys\nsys.path.insert(0, {str(ROOT)!r})\n"
            "from tests import _cpu\n"
            f"counter = _cpu.own_group({group!r})\n"
            "before = counter.seconds()\n"
            f"subprocess.run([sys.executable, '-c', {_BURN!r}], check=True)\n"
            "print(counter.seconds() - before)\n")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=scaled(60))
    finally:  # empty once the probe and its child are gone
        with contextlib.suppress(OSError):
            (_cpu._root() / group).rmdir()
    assert out.returncode == 0, out.stderr
    assert 0.9 <= float(out.stdout) < 3.0, out.stdout


def test_a_forked_script_shows_the_warnings_pythonwarnings_asks_for_as_python_would(tmp_path):
    # A DeprecationWarning raised outside __main__ is hidden by Python's defaults and shown
    # under PYTHONWARNINGS=default; the forked child must do both as a real interpreter does.
    (tmp_path / "old.py").write_text(
        "import warnings\n"
        "def call():\n    warnings.warn('old call', DeprecationWarning, stacklevel=1)\n")
    (tmp_path / "main.py").write_text(  # a forked child finds torch imported by the server
        "import old, sys\nold.call()\nprint('torch' in sys.modules)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for warnings, shown in (("default", True), ("", False), ("ignore,default", True)):
        asked = {"PYTHONWARNINGS": warnings} if warnings else {}
        for how in ("real", "forked"):
            run = (subprocess.run([sys.executable, "-u", str(tmp_path / "main.py")],
                                  env={**env, **asked}, capture_output=True, text=True,
                                  timeout=scaled(60))
                   if how == "real" else
                   _zygote.run_script(str(tmp_path / "main.py"), env=asked, timeout=scaled(60)))
            assert run.stdout.strip() == str(how == "forked"), run.stderr
            assert ("DeprecationWarning: old call" in run.stderr) == shown, (how, warnings,
                                                                             run.stderr)
