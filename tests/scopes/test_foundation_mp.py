"""The foundation's promises on real processes (spawned, gloo on CPU, world sizes 2 and 3)."""

from __future__ import annotations

import pytest
import torch

from .._spawn import spawn
from ..workers import foundation
from ..workers.common import params, train

BATCH = 8


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def ranks(request, tmp_path_factory):
    world = request.param
    return world, spawn(foundation.run_all, world, tmp_path_factory.mktemp("mp"), BATCH)


def _allclose(a, b):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


def test_equivalent_to_one_process_with_the_whole_batch(ranks):
    world, results = ranks
    for kind in ("mlp", "conv"):
        reference = params(train(kind, BATCH * world))
        for r in results:
            _allclose(r["equivalence"][kind], reference)
    reference = params(train("mlp", BATCH * world, epochs=1, num_workers=2))
    for r in results:
        _allclose(r["equivalence"]["mlp_workers"], reference)


def test_model_is_the_same_object_with_the_same_keys(ranks):
    _, results = ranks
    for r in results:
        ident = r["identity"]
        assert ident["same_object"] and ident["class_name"] == "MLP"
        assert ident["keys_same"] and ident["no_module_prefix"] and ident["helper"]
        assert ident["greeting"] == "hello"
        assert ident["engine"] == "DistributedDataParallel"
        assert ident["record_after"] is False


def test_several_models_are_synchronised_and_frozen_ones_are_not_wrapped(ranks):
    _, results = ranks
    gen0, disc0 = results[0]["identity"]["gan"]
    for r in results[1:]:
        gen, disc = r["identity"]["gan"]
        _allclose(gen, gen0)  # started from rank 0's weights, gradients averaged
        _allclose(disc, disc0)
    for r in results:
        assert r["identity"]["frozen_engine"] is False
    # the frozen model was never synchronised: ranks keep their own random init
    assert not torch.equal(results[0]["identity"]["frozen"]["weight"], results[1]["identity"]["frozen"]["weight"])


def test_gradients_are_local_after_the_scope(ranks):
    _, results = ranks
    assert not torch.equal(results[0]["identity"]["grad_after"], results[1]["identity"]["grad_after"])


def test_scopes_one_after_another(ranks):
    world, results = ranks
    evals = {r["sequential"]["eval_correct"] for r in results}
    assert len(evals) == 1  # every rank all-reduced the same count in a second process group
    for i, lr in enumerate((0.01, 0.05, 0.1)):
        reference = params(train("mlp", BATCH * world, epochs=1, lr=lr))
        for r in results:
            _allclose(r["sequential"]["sweep"][i], reference)
    assert all(r["sequential"]["pg_after"] is False for r in results)


def test_sync_batchnorm_on_cpu_warns_once_on_rank_zero(ranks):
    _, results = ranks
    assert [r["sequential"]["syncbn_warned"] for r in results] == [True] + [False] * (len(results) - 1)


def _flatten(batches):
    return [i for b in batches for i in (b if isinstance(b, list) else [b])]


def test_each_rank_loads_only_its_batches_and_all_get_as_many(ranks):
    world, results = ranks
    shards = [r["sharding"] for r in results]
    for key, n in (("random", 23), ("custom", 17)):
        lengths = {len(s[key]) for s in shards}
        assert len(lengths) == 1, f"{key}: ranks got different numbers of batches {lengths}"
        assert all(s[f"{key}_len"] == len(s[key]) for s in shards)
        seen = [i for s in shards for i in _flatten(s[key])]
        assert set(seen) == set(range(n))  # the whole dataset ...
        for s in shards:  # ... and each rank loaded nothing but what it yielded
            assert s[f"{key}_loaded"] == sorted(_flatten(s[key]))
    # padding is whole batches from the start of the epoch, only to fill the last round
    for key in ("random", "custom"):
        all_batches = [b for s in shards for b in s[key]]
        global_batches = sum(1 for _ in all_batches)
        unique = {tuple(b) for b in all_batches}
        assert global_batches - len(unique) < world


def test_iterable_dataset_is_sharded_by_batch(ranks):
    world, results = ranks
    streams = [r["sharding"]["stream"] for r in results]
    assert len({len(s) for s in streams}) == 1
    batches = [list(range(i, min(i + 3, 19))) for i in range(0, 19, 3)]  # 7 batches
    for rank, s in enumerate(streams):
        own = batches[rank::world]
        assert s[: len(own)] == own
        assert all(extra in batches[:world] for extra in s[len(own):])


def test_exact_tail_without_padding(ranks):
    world, results = ranks
    batches = [list(range(i, min(i + 3, 10))) for i in range(0, 10, 3)]
    for rank, r in enumerate(results):
        assert r["sharding"]["exact"] == batches[rank::world]


def test_shuffling_is_shared_by_ranks_and_changes_each_epoch(ranks):
    _, results = ranks
    for epoch in range(2):
        union = sorted(i for r in results for i in r["sharding"]["epochs"][epoch])
        assert union == list(range(12))  # one permutation for all ranks
    assert results[0]["sharding"]["epochs"][0] != results[0]["sharding"]["epochs"][1]


def test_persistent_workers_are_sharded_every_epoch(ranks):
    world, results = ranks
    for epoch in range(2):
        seen = [i for r in results for i in r["sharding"]["persistent"][epoch]]
        assert set(seen) == set(range(14))
        assert len(seen) - 14 < 2 * world  # only the documented padding repeats samples
    assert results[0]["sharding"]["persistent"][0] != results[0]["sharding"]["persistent"][1]


def test_rank_only_preview_does_not_hang_and_training_stays_in_sync(ranks):
    _, results = ranks
    first = results[0]["rank_only"]["after_preview"]
    for r in results[1:]:
        _allclose(r["rank_only"]["after_preview"], first)


def test_a_part_called_alone_with_gradients_warns_on_rank_zero(ranks):
    _, results = ranks
    assert [r["rank_only"]["part_warned"] for r in results] == [True] + [False] * (len(results) - 1)


def test_a_shuffled_loader_in_rank_only_code_is_refused_at_once(ranks):
    """Its order needs a broadcast the other ranks never join: an error, not a wait."""
    _, results = ranks
    message = results[0]["rank_only"]["rank_only_shuffled"]
    assert message is not None and "shuffled DataLoader" in message and "shuffle=False" in message
    assert [r["rank_only"]["rank_only_shuffled"] for r in results[1:]] == [None] * (len(results) - 1)


def test_parameters_a_step_leaves_out_stop_with_the_option_that_fixes_it(ranks):
    """DDP's own message names its constructor, which the user never calls."""
    _, results = ranks
    for rank, r in enumerate(results):
        message = r["rank_only"]["unused_error"]
        assert message is not None and message.startswith(f"rank {rank}:"), message
        assert "distributed(find_unused_parameters=True)" in message


def test_an_evaluation_on_rank_0_only_is_told_it_saw_rank_0s_share(ranks):
    world, results = ranks
    texts = results[0]["rank_only"]["rank_only_evaluation"]
    assert len(texts) == 1, texts
    assert "inside @on_main_process" in texts[0] and f"1/{world} of the data set" in texts[0]
    assert "on each of the" not in texts[0] and "rank 1:" not in texts[0]
    assert all(r["rank_only"]["rank_only_evaluation"] == [] for r in results[1:])


def test_activation_checkpointing_runs_without_warnings(ranks):
    """The blocks torch.utils.checkpoint runs again in the backward are not parts called alone."""
    _, results = ranks
    assert [r["rank_only"]["checkpoint_warnings"] for r in results] == [[]] * len(results)


def test_no_sync_sets_the_users_own_ddp_back(ranks):
    _, results = ranks
    assert all(r["rank_only"]["own_flag_after_no_sync"] is True for r in results)
    for r in results[1:]:  # synchronised again: the same averaged gradient on every rank
        torch.testing.assert_close(r["rank_only"]["own_grad"], results[0]["rank_only"]["own_grad"])


def test_a_group_formed_by_the_user_is_used_and_left_alone(ranks):
    world, results = ranks
    for rank, r in enumerate(results):
        assert r["rank_only"]["own_group"] == (rank, rank, world, world)
        assert r["rank_only"]["own_group_alive"] is True
