"""Undisturbed, replica groups train exactly as plain DDP at the same world size: the data is
split over every group and rank, gradients are averaged over all of them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .. import _launcher

pytest.importorskip("torchft", reason="replica groups need torchft (pip install 'accel-ctx[ft]')")

pytestmark = pytest.mark.usefixtures("_stop_launchers")


def _runs(tmp_path: Path, mode: str = "distributed", **launches: list[str]
          ) -> dict[str, dict[str, object]]:
    """Each launch (its flags, by name) of the script in ``mode``, all side by side (a replica
    group waits on its lighthouse much of the time); each one's record of group 0's rank 0."""
    script = str(_launcher.SCRIPTS / "replica_groups_train.py")
    started = {}
    for name, launch in launches.items():
        out = tmp_path / name
        out.mkdir()
        groups = launch[launch.index("--replica-groups") + 1] if "--replica-groups" in launch else "1"
        started[name] = (out, *_launcher.start([*launch, script, str(out), "8", groups, "-1", "0",
                                                mode], tmp_path, f"{name}.log",
                                               fork_replica_workers=True))
    for _, proc, log in started.values():
        assert _launcher.finish(proc, 300) == 0, log.read_text(errors="replace")[-3000:]
    return {name: torch.load(out / "group0-rank0.pt") for name, (out, _, _) in started.items()}


@pytest.mark.parametrize(("per_group", "world"), [(1, 2), (2, 4)])
def test_replica_groups_equal_ddp_at_the_same_world_size(
        tmp_path: Path, per_group: int, world: int) -> None:
    runs = _runs(tmp_path, groups=["-n", str(per_group), "--replica-groups", "2"],
                 ddp=["-n", str(world)])
    groups, ddp = runs["groups"], runs["ddp"]
    assert [r["step"] for r in groups["seen"]] == list(range(1, 9))  # every step, both groups
    assert all(r["groups"] == 2 for r in groups["seen"])
    for mine, theirs in zip(groups["seen"], ddp["seen"], strict=True):
        assert mine["samples"] == theirs["samples"] and mine["lr"] == theirs["lr"]
    for key, value in ddp["weights"].items():
        torch.testing.assert_close(groups["weights"][key], value, rtol=0, atol=1e-6)


def test_accumulate_and_bf16_in_replica_groups_equal_them_under_ddp(tmp_path: Path) -> None:
    runs = _runs(tmp_path, "accumulate-bf16", groups=["-n", "1", "--replica-groups", "2"],
                 ddp=["-n", "2"])
    groups, ddp = runs["groups"], runs["ddp"]
    steps = [r["step"] for r in groups["seen"]]
    assert steps == [r["step"] for r in ddp["seen"]] and steps[:4] == [0, 1, 1, 2]  # 2 batches a step
    for mine, theirs in zip(groups["seen"], ddp["seen"], strict=True):
        assert mine["samples"] == theirs["samples"] and mine["lr"] == theirs["lr"]
    for key, value in ddp["weights"].items():
        torch.testing.assert_close(groups["weights"][key], value, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("mode", "per_group"), [("clip", 1), ("clip", 2), ("no_sync", 1)])
def test_the_gradients_are_averaged_over_every_group_when_backward_returns_as_under_ddp(
        tmp_path: Path, mode: str, per_group: int) -> None:
    # DDP clips the gradient averaged over every rank (a group must not clip its own first:
    # averaged during the backward in a group of one rank, after the group's DDP in one of
    # two), and averages nothing inside no_sync() (the sum of the step's batches is, after it)
    runs = _runs(tmp_path, mode, groups=["-n", str(per_group), "--replica-groups", "2"],
                 ddp=["-n", str(2 * per_group)])
    groups, ddp = runs["groups"], runs["ddp"]
    assert [r["step"] for r in groups["seen"]] == list(range(1, 9))
    for mine, theirs in zip(groups["seen"], ddp["seen"], strict=True):
        assert mine["samples"] == theirs["samples"]
        if mode == "clip":
            assert theirs["norm"] > 0.05  # every step clipped
            assert mine["norm"] == pytest.approx(theirs["norm"], rel=1e-5, abs=0)
    for key, value in ddp["weights"].items():
        torch.testing.assert_close(groups["weights"][key], value, rtol=0, atol=1e-6)


@pytest.mark.parametrize("shape", ["gan", "checkpoint", "two_losses", "autograd_backward"])
def test_loop_shapes_train_in_replica_groups_as_under_ddp(tmp_path: Path, shape: str) -> None:
    # two models and optimizers, a backward through a frozen layer and a reentrant checkpoint,
    # two backwards before a step, torch.autograd.backward (not patched): each averaged over the
    # groups as DDP averages over its ranks
    script = str(_launcher.SCRIPTS / "replica_loop_shapes.py")
    started = {}
    launches = {"groups": ["-n", "1", "--replica-groups", "2"], "ddp": ["-n", "2"]}
    for name, launch in launches.items():
        out = tmp_path / name
        out.mkdir()
        started[name] = (out, *_launcher.start([*launch, script, str(out), shape], tmp_path,
                                               f"{name}.log", fork_replica_workers=True))
    for _, proc, log in started.values():
        assert _launcher.finish(proc, 300) == 0, log.read_text(errors="replace")[-3000:]
    groups, ddp = (torch.load(out / "group0.pt") for out, _, _ in started.values())
    if shape == "autograd_backward":  # a vote and a commit at every step; a plain scope counts
        # its steps by loss.backward() (README: torch.autograd.backward is not intercepted)
        assert groups["step"] == len(groups["norms"]) > 0
    else:
        assert groups["step"] == ddp["step"] > 0
    for mine, theirs in zip(groups["norms"], ddp["norms"], strict=True):
        assert mine == pytest.approx(theirs, rel=1e-5, abs=1e-7)
    assert groups["weights"].keys() == ddp["weights"].keys()
    for key, value in ddp["weights"].items():
        torch.testing.assert_close(groups["weights"][key], value, rtol=0, atol=1e-6)
