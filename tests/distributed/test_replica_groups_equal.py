"""Undisturbed, replica groups train exactly as plain DDP at the same world size: the data is
split over every group and rank, gradients are averaged over all of them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .. import _launcher

pytest.importorskip("torchft", reason="replica groups need torchft (pip install 'accel-ctx[ft]')")

pytestmark = pytest.mark.usefixtures("_stop_launchers")


def _run(tmp_path: Path, name: str, launch: list[str], groups: int, mode: str = "distributed"
         ) -> dict[str, object]:
    out = tmp_path / name
    out.mkdir()
    script = str(_launcher.SCRIPTS / "replica_groups_train.py")
    proc, log = _launcher.start([*launch, script, str(out), "8", str(groups), "-1", "0", mode],
                                tmp_path, f"{name}.log")
    code = _launcher.finish(proc, 300)
    assert code == 0, log.read_text(errors="replace")[-3000:]
    return torch.load(out / "group0-rank0.pt")


@pytest.mark.parametrize(("per_group", "world"), [(1, 2), (2, 4)])
def test_replica_groups_equal_ddp_at_the_same_world_size(
        tmp_path: Path, per_group: int, world: int) -> None:
    groups = _run(tmp_path, "groups", ["-n", str(per_group), "--replica-groups", "2"], 2)
    ddp = _run(tmp_path, "ddp", ["-n", str(world)], 1)
    assert [r["step"] for r in groups["seen"]] == list(range(1, 9))  # every step, both groups
    assert all(r["groups"] == 2 for r in groups["seen"])
    for mine, theirs in zip(groups["seen"], ddp["seen"], strict=True):
        assert mine["samples"] == theirs["samples"] and mine["lr"] == theirs["lr"]
    for key, value in ddp["weights"].items():
        torch.testing.assert_close(groups["weights"][key], value, rtol=0, atol=1e-6)


def test_accumulate_and_bf16_in_replica_groups_equal_them_under_ddp(tmp_path: Path) -> None:
    groups = _run(tmp_path, "groups", ["-n", "1", "--replica-groups", "2"], 2, "accumulate-bf16")
    ddp = _run(tmp_path, "ddp", ["-n", "2"], 1, "accumulate-bf16")
    steps = [r["step"] for r in groups["seen"]]
    assert steps == [r["step"] for r in ddp["seen"]] and steps[:4] == [0, 1, 1, 2]  # 2 batches a step
    for mine, theirs in zip(groups["seen"], ddp["seen"], strict=True):
        assert mine["samples"] == theirs["samples"] and mine["lr"] == theirs["lr"]
    for key, value in ddp["weights"].items():
        torch.testing.assert_close(groups["weights"][key], value, rtol=0, atol=1e-6)
