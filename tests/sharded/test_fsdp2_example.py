"""pytorch/examples' FSDP2 example (a model built on ``meta``, sharded, then ``to_empty`` and
``reset_parameters()`` or its ``Checkpointer``'s full state dict; explicit prefetching; bf16),
migrated to ``sharded()``, against the same example by hand, in one spawned run on 2 ranks: every
configuration from scratch and then resumed from the checkpoint the first run wrote."""

from __future__ import annotations

import pytest
import torch

from .._spawn import spawn
from ..workers import fsdp2_example as w


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fsdp2-example")
    names = [*w.CONFIGS, *w.METHODS_FIRST]
    return spawn(w.example, 2, folder, str(folder), names, timeout=300)


def _equal(got, want, where):
    if isinstance(want, dict):
        assert sorted(got, key=str) == sorted(want, key=str), where
        for key in want:
            _equal(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            _equal(a, b, f"{where}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype, where
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=where)
    else:
        assert got == want, where


@pytest.mark.parametrize("name", list(w.CONFIGS))
@pytest.mark.parametrize("run", ["fresh", "resumed"])
def test_the_fsdp2_example_built_on_meta_equals_it_by_hand(runs, name, run):
    for rank, result in enumerate(runs):
        hand = result[f"{name} / by hand / {run}"]
        ours = result[f"{name} / sharded() / {run}"]
        assert "error" not in hand, f"rank {rank}: by hand: {hand['error']}"
        assert "error" not in ours, f"rank {rank}: sharded(): {ours['error']}"
        assert ours["resumed"] == hand["resumed"] == (run == "resumed")
        # inspect_model: meta DTensors sharded on dim 0 before any value, as after fully_shard
        assert ours["placements"] == hand["placements"], f"rank {rank}"
        _equal(ours, hand, f"rank {rank}: {name} / {run}")


def test_the_configurations_compared_are_not_one_run(runs):
    # the comparison above means something: bf16 gathers change the numbers, and the resumed
    # run starts from the first run's checkpoint, not from a fresh initialisation
    for result in runs:
        fp32 = result["dtensor / by hand / fresh"]["losses"]
        assert result["dtensor bf16 / by hand / fresh"]["losses"] != fp32
        assert result["dtensor / by hand / resumed"]["losses"][0] != fp32[0]


@pytest.mark.parametrize("run", ["fresh", "resumed"])
def test_fsdp2_methods_before_any_touch_shard_the_model_as_fully_shard_would(runs, run):
    # the example with its prefetching set first thing after building on meta: the method
    # call itself is the touch that shards the model
    for rank, result in enumerate(runs):
        hand = result[f"dtensor methods first / by hand / {run}"]
        ours = result[f"dtensor methods first / sharded() / {run}"]
        assert "error" not in hand, f"rank {rank}: by hand: {hand.get('error')}"
        assert "error" not in ours, f"rank {rank}: sharded(): {ours.get('error')}"
        _equal(ours, hand, f"rank {rank}: methods first / {run}")


def test_fsdp2_methods_where_nothing_is_sharded_say_why(runs):
    for rank, said in enumerate(result["messages"] for result in runs):
        assert "no sharded() scope" in said["ddp"] and "DDP" in said["ddp"], said["ddp"]
        if rank == 0:
            assert "on_main_process" in said["rank_only"] and "every rank" in said["rank_only"]
        else:
            assert said["rank_only"] is None  # rank 1 runs none of it
        assert said["hasattr"] == "True"  # a probe by the script is a touch too
        assert "sharded(blocks=[Attention])" in said["inner"], said["inner"]
        assert said["block"] is None


def test_an_fsdp2_method_in_one_process_says_to_guard_it():
    from torch import nn

    from accel_ctx import sharded

    with sharded():
        model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        with pytest.raises(AttributeError, match=r"one process.*isinstance\(model, FSDPModule\)"):
            model.unshard()
        assert not hasattr(model, "reshard")
