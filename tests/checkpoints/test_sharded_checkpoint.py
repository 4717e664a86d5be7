"""save_state / load_state / save_model under sharded() (FSDP2 shards through DCP).

A sharded run stopped mid-epoch and resumed in fresh processes ends bit-identical to the run
that never stopped (AdamW: the optimizer's sharded state round-trips exactly). A checkpoint saved
on 2 ranks resumes on 1 and on 3 (DCP reshards; with the same 6 batches per optimizer step the
result is allclose to the 2-rank run). A DDP checkpoint resumes sharded and a sharded one under
DDP. save_model writes full weights that load into a fresh plain model with torch alone.
"""

from __future__ import annotations

import pytest
import torch

from .._spawn import spawn
from ..workers import sharded as w


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharded-ckpt")
    root = str(tmp / "ckpt")
    stopped = spawn(w.checkpoint_stops, 2, tmp, root, timeout=300)
    resumed = spawn(w.checkpoint_resumes, 2, tmp, root, timeout=300)
    return root, tmp, stopped, resumed


def _equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), what
    for key, value in want.items():
        assert torch.equal(got[key], value), f"{what}: {key}"


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), what
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=f"{what}: {key}")


def test_a_sharded_run_resumed_mid_epoch_ends_bit_identical(runs):
    _, _, stopped, resumed = runs
    for rank in range(2):
        full, after = stopped[rank]["full"], resumed[rank]["sharded"]
        assert after["resumed"] == (stopped[rank]["stop"]["step"], 2)
        _equal(after["loaded"], stopped[rank]["stop"]["weights"], "the loaded weights")
        _equal(after["weights"], full["weights"], f"rank {rank}: resumed vs uninterrupted")
        assert after["step"] == full["step"]


def test_checkpoints_move_between_ddp_and_sharded_runs(runs):
    _, _, stopped, resumed = runs
    for rank in range(2):
        into_sharded = resumed[rank]["ddp_to_sharded"]
        _equal(into_sharded["loaded"], stopped[rank]["ddp_stop"]["weights"], "DDP -> sharded")
        _close(into_sharded["weights"], stopped[rank]["ddp_full"]["weights"], "DDP -> sharded")
        _close(stopped[rank]["sgd_full"]["weights"], stopped[rank]["ddp_full"]["weights"],
               "the uninterrupted runs agree")
        into_ddp = resumed[rank]["sharded_to_ddp"]
        _equal(into_ddp["loaded"], stopped[rank]["sgd_stop"]["weights"], "sharded -> DDP")
        _close(into_ddp["weights"], stopped[rank]["sgd_full"]["weights"], "sharded -> DDP")


@pytest.mark.parametrize("world", [1, 3])
def test_saved_on_2_ranks_resumed_on_another_number(runs, world):
    root, tmp, stopped, _ = runs
    results = spawn(w.checkpoint_other_world, world, tmp, root, timeout=300)
    reference = stopped[0]["reshard_full"]
    for result in results:
        assert result["resumed"] == (stopped[0]["reshard_stop"]["step"], 2)
        _equal(result["loaded"], stopped[0]["reshard_stop"]["weights"], "loaded")
        _close(result["weights"], reference["weights"], f"resumed on {world}")
        assert result["step"] == reference["step"]


def test_save_model_writes_full_weights_that_plain_torch_loads(runs):
    root, _, stopped, _ = runs
    fresh = w.GPT()
    fresh.load_state_dict(torch.load(f"{root}/model.pt", weights_only=True))
    _equal({k: v.detach() for k, v in fresh.state_dict().items()},
           stopped[0]["full"]["weights"], "save_model")
    assert fresh.wte.weight is fresh.lm_head.weight


def test_a_checkpoint_inside_an_accumulation_group_says_the_partial_sums_are_lost(runs):
    # FSDP2 holds a group's partial gradients unsharded inside its engine: they are not saved,
    # and the resumed run says so and starts the group afresh instead of silently dropping them.
    _, _, stopped, resumed = runs
    for rank in range(2):
        assert stopped[rank]["mid_group_stop"]["step"] == 1
        assert any("sharded model" in m for m in resumed[rank]["warnings"])
        assert resumed[rank]["mid_group"]["step"] > 1
