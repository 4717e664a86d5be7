"""Fault-tolerant replica groups (`accel-ctx launch --replica-groups`, torchft): a real launcher
run on gloo, one group's worker SIGKILLed mid-run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .. import _launcher

pytest.importorskip("torchft", reason="replica groups need torchft (pip install 'accel-ctx[ft]')")

pytestmark = pytest.mark.usefixtures("_stop_launchers")


@pytest.fixture
def _stop_launchers():
    yield
    _launcher.stop_all()


def test_a_killed_group_restarts_heals_from_its_peer_and_the_other_never_stops(
        tmp_path: Path) -> None:
    script = str(_launcher.SCRIPTS / "replica_groups_train.py")
    proc, log = _launcher.start(
        ["-n", "1", "--replica-groups", "2", "--max-restarts", "2", script, str(tmp_path),
         "10", "2", "1", "5"], tmp_path, "launch.log")
    code = _launcher.finish(proc, 400)
    text = log.read_text(errors="replace")
    assert code == 0, text[-3000:]
    survivor = torch.load(tmp_path / "group0.pt")
    healed = torch.load(tmp_path / "group1.pt")
    assert survivor["restart"] == 0, text[-3000:]  # the survivor never restarted
    assert healed["restart"] == 1, text[-3000:]
    steps = [s for s, _ in survivor["seen"]]
    assert steps == sorted(steps) and steps[-1] == healed["seen"][-1][0]
    assert 1 in [n for _, n in survivor["seen"]]  # it went on alone meanwhile
    assert survivor["seen"][-1][1] == 2 and healed["seen"][-1][1] == 2  # together again
    assert healed["seen"][0][0] > 5  # the restarted group began where its peer was
    for key, value in survivor["weights"].items():
        assert torch.equal(value, healed["weights"][key]), key
