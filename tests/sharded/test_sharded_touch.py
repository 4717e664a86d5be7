"""Under sharded(), a script that touches the model before its first forward sees what
hand-written FSDP2 shows after fully_shard: pytorch/examples' FSDP2 example, migrated, on 2
real ranks, through both of its checkpoint paths (DCP and DTensor state dicts)."""

from __future__ import annotations

import pytest
import torch

from .._spawn import spawn
from ..workers import sharded_touch as w


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("touch")
    return spawn(w.example, 2, folder, str(folder), timeout=240)


@pytest.mark.parametrize("path", ["dcp", "dtensor"])
def test_the_fsdp2_example_migrated_equals_it_by_hand(runs, path):
    for rank, result in enumerate(runs):
        ours, hand = result[f"{path} sharded()"], result[f"{path} by hand"]
        # inspect_model before any forward: DTensors sharded on dim 0, as after fully_shard
        assert ours["placements"] == hand["placements"], f"rank {rank}"
        assert all(p == "DTensor:(Shard(dim=0),)" for p in ours["placements"]), ours
        assert ours["losses"] == hand["losses"], f"rank {rank}"
        assert sorted(ours["weights"]) == sorted(hand["weights"])
        for key, value in hand["weights"].items():
            torch.testing.assert_close(ours["weights"][key], value, rtol=0, atol=0,
                                       msg=f"rank {rank}: {key}")


def test_a_model_built_on_meta_resumes_through_load_state_exactly(runs):
    # sharded on meta when Adam is made over it, given values by load_state (or, without a
    # checkpoint, at its first forward): 2 steps, saved, resumed for 2 more = 4 steps in one go
    for rank, result in enumerate(runs):
        whole, resumed = result["meta whole"], result["meta resumed"]
        assert sorted(resumed) == sorted(whole)
        for key, value in whole.items():
            torch.testing.assert_close(resumed[key], value, rtol=0, atol=0,
                                       msg=f"rank {rank}: {key}")
