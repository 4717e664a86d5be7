"""The README's quick start: the main demo runs on two processes through the launcher."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ._timeouts import scaled

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_main_demo_trains_on_two_processes():
    launcher = shutil.which("accel-ctx") or str(Path(sys.executable).parent / "accel-ctx")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [launcher, "launch", "-n", "2", "examples/train.py", "--epochs", "2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=scaled(180),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("epoch")]
    assert len(lines) == 2  # printed by rank 0 only
    assert all("(2 processes on cpu, fp32)" in line for line in lines)
    assert out.stdout.splitlines()[0].startswith("training: 2 processes on cpu, fp32; 2 epochs")
    assert out.stdout.splitlines()[-1].startswith("done in ")  # the summary, once
