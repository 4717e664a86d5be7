"""Issue 11, `accel-ctx launch` for real: the script's exit code, Ctrl-C (14), and the demo
following the launcher's --mixed-precision (16).

Every command runs with a timeout; past it the launcher's process group gets SIGTERM, then
SIGKILL, so a test can fail but never hang.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from .._launcher import ROOT, SCRIPTS, alive, finish, start, stop_all
from .._timeouts import hint, scaled

pytestmark = pytest.mark.slow

SCRIPT = SCRIPTS / "exit_or_wait.py"


@pytest.fixture(autouse=True)
def _no_job_left_behind():
    yield
    stop_all()


def test_the_launcher_exits_with_the_scripts_code_and_with_130_after_one_line_on_ctrl_c(tmp_path):
    proc, log = start(["-n", "2", str(SCRIPT), "exit", "3"], tmp_path, "exit.log")
    code = finish(proc, 120)
    text = log.read_text()
    assert code == 3, text
    assert "rank 1 (local rank 1" in text and "exited with code 3" in text

    proc, log = start(["-n", "2", str(SCRIPT), "wait", str(tmp_path)], tmp_path, "int.log")
    pid_files = [tmp_path / f"pid.{r}" for r in range(2)]
    deadline = time.monotonic() + scaled(120)
    while not all(p.exists() for p in pid_files):
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, f"{log.read_text()}\n{hint()}"
        time.sleep(0.1)
    pids = [int(p.read_text()) for p in pid_files]
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole foreground group
    code = finish(proc, 60)
    lines = log.read_text().splitlines()
    assert code == 130, lines
    assert lines == ["accel-ctx launch: interrupted (Ctrl-C); every worker was stopped."]
    deadline = time.monotonic() + scaled(30)
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)


def test_the_demo_follows_the_launchers_precision_and_a_conflict_is_said_once(tmp_path):
    demo = [str(ROOT / "examples" / "train.py"), "--epochs", "1"]
    proc, log = start(["-n", "2", "--mixed-precision", "bf16", *demo], tmp_path, "bf16.log")
    no_proc, no_log = start(["-n", "2", "--mixed-precision", "bf16", *demo, "--precision", "no"],
                            tmp_path, "no.log")  # independent of the first: side by side
    assert finish(proc, 180) == 0, log.read_text()[-3000:]
    text = log.read_text()
    epochs = [line for line in text.splitlines() if line.startswith("epoch")]
    assert len(epochs) == 1 and epochs[0].endswith("(2 processes on cpu, bf16)"), text
    assert "overrides" not in text

    assert finish(no_proc, 180) == 0, no_log.read_text()[-3000:]
    text = no_log.read_text()
    epochs = [line for line in text.splitlines() if line.startswith("epoch")]
    assert len(epochs) == 1 and epochs[0].endswith("fp32)"), text  # the explicit one wins
    assert text.count("mixed_precision('no') in the script overrides the launcher's "
                      "--mixed-precision bf16") == 1, text  # said once, by rank 0
