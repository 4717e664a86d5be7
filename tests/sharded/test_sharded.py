"""sharded(): FSDP2 under the plain loop, on 2 and 3 real ranks (spawned, gloo on CPU).

The same loop (a GPT-shaped model with tied embeddings, SGD with momentum, shuffled loader) ends
allclose to one process with batch W·b and to distributed() alone: also under accumulate(2),
with the optimizer made after the first forward, with clipping, for a model built on meta (it
starts from the very weights one process would draw), with a frozen sub-module, and for two
models with two optimizers. Each rank holds 1/W of the parameter, gradient and optimizer bytes.
"""

from __future__ import annotations

import pytest
import torch

from .._spawn import spawn
from ..workers import sharded as w

BATCH = 4


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), what
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=f"{what}: {key}")


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def runs(request, tmp_path_factory):
    world = request.param
    per_rank = spawn(w.equivalence, world, tmp_path_factory.mktemp("sharded"), BATCH,
                     timeout=300)
    return world, per_rank


def test_sharded_trains_like_one_process_and_like_ddp(runs):
    world, per_rank = runs
    reference = w.train("plain", BATCH * world)["weights"]
    for rank, result in enumerate(per_rank):
        assert result["world"] == world
        _close(result["sharded"]["weights"], reference, f"rank {rank}: sharded vs one process")
        _close(result["sharded"]["weights"], result["ddp"]["weights"],
               f"rank {rank}: sharded vs distributed()")
        assert result["sharded"]["step"] == result["ddp"]["step"]


def test_sharded_opens_the_job_itself(runs):
    world, per_rank = runs
    reference = w.train("plain", BATCH * world, epochs=1)["weights"]
    for result in per_rank:
        _close(result["alone"]["weights"], reference, "sharded() without distributed()")


def test_accumulation_skips_the_reduce_scatter_and_ends_the_same(runs):
    world, per_rank = runs
    reference = w.train("plain", BATCH * world, k=2)["weights"]
    for result in per_rank:
        _close(result["sharded_acc"]["weights"], reference, "accumulate(2) vs one process")
        _close(result["sharded_acc"]["weights"], result["ddp_acc"]["weights"],
               "accumulate(2): sharded vs distributed()")
        assert result["sharded_acc"]["step"] == result["ddp_acc"]["step"]


def test_optimizers_made_before_or_after_the_first_forward_step_the_shards(runs):
    world, per_rank = runs
    reference = w.train("plain", BATCH * world, epochs=1)["weights"]
    for result in per_rank:
        for name in ("sharded", "opt_after"):
            assert result[name]["opt_params_are_model_params"], name
        _close(result["opt_after"]["weights"], reference, "optimizer made after the forward")


def test_clipping_uses_the_global_norm_of_the_sharded_gradients(runs):
    world, per_rank = runs
    reference = w.train("plain", BATCH * world, epochs=1, clip=0.05)["weights"]
    unclipped = w.train("plain", BATCH * world, epochs=1)["weights"]
    assert any(not torch.allclose(reference[k], unclipped[k]) for k in reference)  # it clips
    for result in per_rank:
        _close(result["clip"]["weights"], reference, "clip_grad_norm_ vs one process")
        _close(result["clip"]["weights"], result["ddp_clip"]["weights"], "clip vs DDP")


def test_a_model_built_on_meta_starts_from_the_weights_one_process_draws(runs):
    # Materialised at its first forward (after the loader drew its shuffle), from rank 0's
    # random stream: the same script in one process gives the same model, not a mix of ranks.
    world, per_rank = runs
    reference = w.train("sharded_alone", BATCH * world, epochs=1, meta=True)["weights"]
    built_on_cpu = w.train("plain", BATCH * world, epochs=1)["weights"]
    assert not torch.equal(reference["h.0.qkv.weight"], built_on_cpu["h.0.qkv.weight"])
    for result in per_rank:
        _close(result["meta"]["weights"], reference, "built on meta")


def test_a_frozen_submodule_stays_as_it_was(runs):
    world, per_rank = runs
    reference = w.train("plain", BATCH * world, epochs=1, frozen=True)["weights"]
    initial = w.train("plain", BATCH * world, epochs=0)["weights"]
    for result in per_rank:
        _close(result["frozen"]["weights"], reference, "frozen wpe")
        torch.testing.assert_close(result["frozen"]["weights"]["wpe.weight"],
                                   initial["wpe.weight"], rtol=0, atol=0)


def test_each_rank_holds_a_1_over_w_share_of_the_training_state(runs):
    world, per_rank = runs
    for result in per_rank:
        ddp, shard = result["ddp"]["bytes"], result["sharded"]["bytes"]
        assert shard <= ddp / world * 1.10, (shard, ddp, world)


def test_the_model_keeps_its_class_keys_and_ties(runs):
    _, per_rank = runs
    plain_keys = sorted(w.GPT().state_dict())
    for result in per_rank:
        got = result["sharded"]
        assert got["isinstance"] and got["class"].endswith("GPT")
        assert got["keys"] == plain_keys  # no wrapper prefix
        assert got["tied"]


def test_two_models_with_two_optimizers(tmp_path):
    per_rank = spawn(w.gan, 2, tmp_path, BATCH, timeout=180)
    reference = w.gan(BATCH * 2, "plain")
    for result in per_rank:
        _close(result["gen"], reference["gen"], "generator")
        _close(result["critic"], reference["critic"], "critic")
