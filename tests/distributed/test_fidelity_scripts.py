"""A third-party script run as its authors run it (torchrun + DDP) and migrated with the smallest
change (``accel-ctx launch``): the PyTorch DDP tutorial's trainer, which peeks at a batch before
its own ``set_epoch``, saves ``model.module.state_dict()`` and pickles the whole model."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from .._launcher import ROOT, SCRIPTS, STARTED, finish, start, stop_all
from .._timeouts import scaled

LINES = re.compile(r"(rank \d+ epoch \d+ batches [0-9a-f]{12}|rank \d+ weights [0-9a-f]{12}"
                   r"|loaded epochs_run \d+ [0-9a-f]{12})")


@pytest.fixture(autouse=True)
def _no_launcher_left():
    yield
    stop_all()


def _facts(output: str) -> set[str]:
    return set(LINES.findall(output))


FACTS = 2 * 3 + 2 + 1  # per rank: 3 epochs and the weights; the load
# The tutorial destroys its process group while its DDP model is still alive (freed when main()
# returns): torch 2.13's gloo then sometimes aborts a rank as the process exits.
TEARDOWN_ABORT = "terminate called without an active exception"


def _reference_ran(returncode: int, stdout: str, stderr: str) -> bool:
    """The tutorial by hand reported everything: it exited cleanly, or torch aborted it in that
    teardown after every line was printed."""
    return returncode == 0 or (TEARDOWN_ABORT in stderr and len(_facts(stdout)) == FACTS)


def test_the_ddp_tutorial_migrated_trains_on_the_same_batches_and_saves_what_loads(tmp_path):
    script = str(SCRIPTS / "ddp_tutorial.py")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    by_hand = subprocess.Popen(  # the two runs are independent: side by side
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         script, str(tmp_path / "hand.pt")],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    STARTED.append(by_hand)  # stopped with its workers if the test fails (stop_all)
    proc, log = start(["-n", "2", script, str(tmp_path / "accel.pt"), "--accel"], tmp_path,
                      "accel.log")
    stdout, stderr = by_hand.communicate(timeout=scaled(180))
    assert _reference_ran(by_hand.returncode, stdout, stderr), stdout + stderr
    assert finish(proc, timeout=180) == 0, log.read_text()
    reference, migrated = _facts(stdout), _facts(log.read_text())
    assert len(reference) == FACTS
    assert migrated == reference
