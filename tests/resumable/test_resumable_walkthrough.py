"""The hard-kill walkthrough of docs/resumable.md, run as it is written there (issue 52): the
example killed at step 7 under ``accel-ctx launch -n 2 --max-restarts 3`` is restarted once and
carries on to its end, printing its last line once (on the main process)."""

from __future__ import annotations

import re

import pytest

from .. import _launcher

EXAMPLE = str(_launcher.ROOT / "examples" / "resumable_train.py")


@pytest.fixture(autouse=True)
def _stop_launchers():
    yield
    _launcher.stop_all()


def test_the_docs_hard_kill_walkthrough_carries_on_to_the_end(tmp_path):
    proc, log = _launcher.start(["-n", "2", "--max-restarts", "3", EXAMPLE, "--out", "run",
                                 "--crash-at-step", "7"], tmp_path, "walkthrough.log")
    code = _launcher.finish(proc, 240)
    text = log.read_text()
    assert code == 0, text[-4000:]
    assert "crashing at step 7" in text, text[-4000:]  # the first attempt only
    assert len(re.findall(r"resuming from ckpt-\S+ \(step [36], epoch 0\)", text)) == 1, text
    assert len(re.findall(r"^done: step 12, weights checksum \S+$", text, re.M)) == 1, text
