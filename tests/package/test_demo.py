"""The README's quick start: the main demo runs on two processes through the launcher and prints
the lines the README shows."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .._timeouts import scaled
from .test_examples import unexpected_warnings

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _readme_output() -> tuple[str, list[str]]:
    """The torch version the README's demo output was taken with, and the lines it shows."""
    intro = README[README.index("The demo prints"):]
    version = re.search(r"with torch (\d+\.\d+)'s CPU build", intro)
    assert version, "the README no longer says which torch printed the demo's output"
    block = intro[intro.index("```text\n") + len("```text\n"):]
    return version.group(1), block[:block.index("```")].splitlines()


@pytest.mark.slow
def test_main_demo_prints_what_the_readme_shows():
    launcher = shutil.which("accel-ctx") or str(Path(sys.executable).parent / "accel-ctx")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "default"}
    out = subprocess.run(  # the README's command: `./dev demo` runs it
        [launcher, "launch", "-n", "2", "examples/train.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=scaled(600),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert not unexpected_warnings(out.stderr), out.stderr[-3000:]  # issue 41
    printed = out.stdout.splitlines()
    epochs = [line for line in printed if line.startswith("epoch")]
    assert len(epochs) == 20  # printed by rank 0 only
    assert printed[0] == "training: 2 processes on cpu, fp32; 20 epochs of 16 batches per process"
    assert all(line.endswith("(2 processes on cpu, fp32)") for line in epochs)
    assert re.fullmatch(r"done in \d+\.\d s: final accuracy 0\.\d{3} on the spirals: OK",
                        printed[-1])  # the summary, once

    version, shown = _readme_output()
    if not torch.__version__.startswith(version + "."):
        return  # the numbers of another torch may differ in the last digits, as the README says
    # Every line the README shows, in order, one after the other unless "..." stands between
    # them for lines left out; the time is the machine's.
    parts, gap = [], False
    for line in shown:
        if line == "...":
            gap = True
            continue
        if parts:
            parts.append(r"\n(?:.*\n)*?" if gap else r"\n")
        parts.append(r"done in \d+\.\d s" + re.escape(line[line.index(":"):])
                     if line.startswith("done in ") else re.escape(line))
        gap = False
    pattern = "(?m)^" + "".join(parts) + "$"
    assert re.search(pattern, "\n".join(printed) + "\n"), (
        "the README's demo output is not what the demo prints; update the README with:\n"
        + out.stdout)
