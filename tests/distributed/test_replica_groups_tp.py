"""Tensor parallelism inside replica groups (torchft's HSDP: TP inside a group, fault tolerance
across): sharded(tp=2) on accel-ctx launch -n 2 --replica-groups 2 --max-restarts 1 (real
torchft, gloo): group 1, killed at step 3, restarts, heals each rank's shards from the same rank
of group 0 and equals it, bit for bit, at every step after, while group 0 never stops."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .. import _launcher

pytest.importorskip("torchft", reason="replica groups need torchft (pip install 'accel-ctx[ft]')")

pytestmark = pytest.mark.usefixtures("_stop_launchers")


def test_tp_inside_two_groups_is_bit_identical_and_a_killed_group_heals_its_shards(
        tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    script = str(_launcher.SCRIPTS / "replica_tp.py")
    proc, log = _launcher.start(["-n", "2", "--replica-groups", "2", "--max-restarts", "1",
                                 script, str(out), "8", "1", "3"], tmp_path, "tp.log",
                                fork_replica_workers=True)
    code = _launcher.finish(proc, 300)
    text = log.read_text(errors="replace")
    assert code == 0, text[-3000:]
    assert "replica group 1 healed from replica group 0" in text, text[-3000:]
    for rank in (0, 1):
        survivor, healed = (torch.load(out / f"group{g}-rank{rank}.pt") for g in (0, 1))
        assert survivor["restart"] == 0 and healed["restart"] == 1
        by_step = {s["step"]: s for s in survivor["seen"]}
        assert sorted(by_step) == list(range(1, len(by_step) + 1))  # it never stopped
        assert healed["seen"][0]["step"] > 3 and len(healed["seen"]) >= 4
        for s in healed["seen"]:
            for name, shard in s["shards"].items():
                assert torch.equal(shard, by_step[s["step"]]["shards"][name]), (rank, s["step"])
    # the two ranks of a group hold different halves of the split layers
    halves = [torch.load(out / f"group0-rank{r}.pt")["seen"][-1]["shards"] for r in (0, 1)]
    assert not torch.equal(halves[0]["0.weight"], halves[1]["0.weight"])
