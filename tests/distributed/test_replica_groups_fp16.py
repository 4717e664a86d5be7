"""fp16 over replica groups across a kill (accel-ctx launch -n 1 --replica-groups 2
--max-restarts 1, real torchft, gloo): the GradScaler really overflows (every 4th step's loss is
made huge), so its scale and growth tracker have moved before group 1 is killed; the restarted
group heals from its peer and from its first step on holds the peer's loss scale and weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .. import _launcher

pytest.importorskip("torchft", reason="replica groups need torchft (pip install 'accel-ctx[ft]')")

pytestmark = pytest.mark.usefixtures("_stop_launchers")

STEPS, KILL_AT, OVERFLOW_EVERY = 12, 7, 4


def test_a_killed_group_heals_the_fp16_loss_scale_of_its_peer(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    script = str(_launcher.SCRIPTS / "replica_fp16.py")
    proc, log = _launcher.start(
        ["-n", "1", "--replica-groups", "2", "--max-restarts", "1", script, str(out),
         str(STEPS), "1", str(KILL_AT), str(OVERFLOW_EVERY)], tmp_path, "fp16.log",
        fork_replica_workers=True)
    code = _launcher.finish(proc, 300)
    text = log.read_text(errors="replace")
    assert code == 0, text[-3000:]
    assert "replica group 1 healed from replica group 0" in text, text[-3000:]
    survivor, healed = (torch.load(out / f"group{g}-rank0.pt") for g in (0, 1))
    assert survivor["restart"] == 0 and healed["restart"] == 1
    by_step = {s["step"]: s for s in survivor["seen"]}
    assert sorted(by_step) == list(range(1, len(by_step) + 1))  # the survivor never stopped
    before = [by_step[step] for step in range(1, KILL_AT + 1)]
    # the scale really moved before the kill: skipped steps, and more than one scale
    assert before[-1]["skipped"] > 0 and len({s["scale"] for s in before}) > 1, before
    first = healed["seen"][0]["step"]
    assert first > KILL_AT, first
    for s in healed["seen"]:
        peer = by_step[s["step"]]
        assert s["scale"] == peer["scale"], (s["step"], s["scale"], peer["scale"])
        assert s["skipped"] == peer["skipped"], (s["step"], s["skipped"], peer["skipped"])
        for name, value in s["weights"].items():
            assert torch.equal(value, peer["weights"][name]), (s["step"], name)
    # the scaler was exercised after the heal too: an overflow, and the scale moved
    after = healed["seen"]
    assert after[-1]["skipped"] > after[0]["skipped"], after
    assert len({s["scale"] for s in after}) > 1, after
