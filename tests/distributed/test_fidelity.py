"""Issue 23: real scripts, migrated with one line, give hand-written DDP's results or say why not.

Each section of ``workers.fidelity`` runs a script written the way third-party scripts are
(the DDP tutorial's trainer, per-rank seeds, nanoGPT's micro-steps, the MNIST example's test(),
batches made without a DataLoader, helper threads) by hand with torchrun-style DDP and under
accel_ctx, in the same spawned processes; these tests compare them rank by rank.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from accel_ctx import distributed, mixed_precision, no_sync

from .._spawn import spawn
from ..workers import fidelity


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def ranks(request, tmp_path_factory):
    world = request.param
    return world, spawn(fidelity.run_all, world, tmp_path_factory.mktemp("fidelity"), timeout=240)


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


# ---- 1. the DDP tutorial: next(iter(loader)) before set_epoch -----------------------------------------
def test_a_peek_at_a_batch_does_not_steal_an_epoch_from_a_loop_that_calls_set_epoch(ranks):
    _, results = ranks
    for rank, part in enumerate(r["tutorial"] for r in results):
        reference = part["reference"]
        assert reference["seen"][0] != reference["seen"][1]  # the epochs do differ
        for migrated in (part["migrated"], part["kept_ddp"]):
            assert migrated["seen"] == reference["seen"], f"rank {rank}: other batches than DDP"
            assert _equal(migrated["weights"], reference["weights"])


# ---- 2. per-rank seeds ----------------------------------------------------------------------------------
def test_each_rank_keeps_its_own_random_stream_through_shuffled_epochs(ranks):
    world, results = ranks
    parts = [r["rank_seeds"] for r in results]
    for rank, part in enumerate(parts):
        # after two shuffled epochs, each rank draws what the same script draws under DDP
        assert part["accel"]["draws"] == part["reference"]["draws"], f"rank {rank}"
        assert part["accel_workers"]["draws"] == part["reference_workers"]["draws"], f"rank {rank}"
    assert len({str(p["accel"]["draws"]) for p in parts}) == world  # and they differ by rank
    # the order is still one order, split between the ranks: each sample once per epoch
    for kind in ("accel", "accel_workers"):
        per_epoch = len(parts[0][kind]["batches"]) // 2
        for epoch in range(2):
            samples = sorted(x for p in parts
                             for b in p[kind]["batches"][epoch * per_epoch:(epoch + 1) * per_epoch]
                             for x in b)
            assert samples == [float(i) for i in range(48)]


# ---- 3. torch.save(model), pickle, deepcopy, repr ----------------------------------------------------
def test_an_adopted_model_saves_copies_and_prints_as_plain_torch_gives(ranks):
    _, results = ranks
    for part in (r["saving"] for r in results):
        plain, scoped = part["plain"], part["scoped"]
        assert plain["load"]["ok"], plain["load"]  # the reference: plain torch loads it
        assert scoped["load"]["ok"], scoped["load"]
        assert _equal(scoped["load"]["weights"], scoped["weights"])
        for key in ("vars", "deepcopy_vars", "pickle_vars", "repr", "deepcopy_runs"):
            assert scoped[key] == plain[key], key


def test_nothing_of_ours_is_left_on_a_module_in_one_process():
    with distributed(), mixed_precision("bf16"):
        model = fidelity.Net()
        before = set(vars(model))
        model(torch.randn(2, 4)).sum().backward()
        with no_sync():
            model(torch.randn(2, 4)).sum().backward()
        assert set(vars(model)) == before
        assert set(vars(copy.deepcopy(model))) == before
        assert set(vars(pickle.loads(pickle.dumps(model)))) == before


def test_a_model_a_failed_batch_size_attempt_adopted_is_freed_for_the_retry(ranks):
    _, results = ranks
    for part in (r["dropped_models"] for r in results):
        assert part == {"size": 4, "first_freed": True, "second_kept": True}


# ---- 4. DDP's own controls -------------------------------------------------------------------------------
def test_require_backward_grad_sync_and_no_sync_on_the_model_work_as_in_ddp(ranks):
    _, results = ranks
    for rank, part in enumerate(r["ddp_controls"] for r in results):
        for style in ("flag", "no_sync"):
            mine, reference = part[f"accel_{style}"], part[f"reference_{style}"]
            assert _equal(mine["weights"], reference["weights"]), (rank, style)
            # a micro-step that skipped the all-reduce leaves this rank's own gradient, as DDP
            for ours, theirs in zip(mine["local_grads"], reference["local_grads"], strict=True):
                assert torch.equal(ours, theirs), (rank, style)
    firsts = [r["ddp_controls"]["accel_flag"]["local_grads"][0] for r in results]
    assert not all(torch.equal(firsts[0], g) for g in firsts[1:])  # not averaged: they differ


def test_model_module_says_there_is_no_wrapper_and_getattr_fallbacks_still_work(ranks):
    _, results = ranks
    part = results[0]["ddp_controls"]
    assert "accel_ctx does not wrap your model" in part["module_error"]
    assert "getattr(model, 'module', model)" in part["module_error"]
    assert part["hasattr_module"] is False and part["getattr_default"] is True
    assert part["default_flag"] is True
    assert part["vars_after"] == part["vars_plain"]
    assert part["outside"] == "'Sequential' object has no attribute 'no_sync'"


def test_missing_attributes_outside_ddps_names_stay_torchs_own():
    with distributed():
        model = nn.Linear(2, 2)
        with pytest.raises(AttributeError, match=r"^'Linear' object has no attribute 'wieght'$"):
            model.wieght  # noqa: B018
        assert model.weight is model._parameters["weight"]
        with model.no_sync():  # one process: nothing to skip, and it still works
            model(torch.randn(1, 2)).sum().backward()
    with pytest.raises(AttributeError, match=r"has no attribute 'module'$"):
        model.module  # noqa: B018


# ---- 5. evaluation loops that sum their own counts ------------------------------------------------
def test_an_evaluation_that_counts_only_its_share_warns_once_on_rank_zero(ranks):
    world, results = ranks
    rows = [r["evaluation"] for r in results]
    alone = rows[0]["none-True"]
    assert len(alone["warnings"]) == 1  # two evaluations of one loader: said once
    text = alone["warnings"][0]
    assert "TensorDataset (2500 samples in batches of 1000" in text
    assert "fidelity.py" in text and "in _test" in text  # the loop's line
    assert f"each of the {world} processes" in text and "rank 1: " in text
    assert "gather_for_metrics" in text and "reduce" in text
    for row in rows[1:]:
        assert row["none-True"]["warnings"] == []  # rank 0 only
    assert sum(r["none-True"]["counts"][0] for r in rows) >= 2500  # each rank its share


def test_counts_reduced_over_padded_evaluations_are_warned_about_and_exact_without_padding(ranks):
    world, results = ranks
    rows = [r["evaluation"] for r in results]
    for combine in ("reduce-True", "all_reduce-True"):
        counts = rows[0][combine]["counts"]
        padded = -3 % world  # 3 batches of the 2500 samples; the last round is padded
        assert counts == [2500 + padded * 1000] * 2
        if padded:  # world 2: the sums are wrong, and said to be
            assert len(rows[0][combine]["warnings"]) == 1
            assert "include them twice" in rows[0][combine]["warnings"][0]
        else:  # world 3: whole rounds, nothing repeated, nothing to say
            assert rows[0][combine]["warnings"] == []
    for combine in ("gather_for_metrics-True", "reduce-False"):
        for row in rows:
            assert row[combine]["counts"] == [2500, 2500]
            assert row[combine]["warnings"] == []


def test_the_mnist_examples_last_evaluation_in_main_is_warned_about_at_the_jobs_end(ranks):
    # issue 38: with its loaders local to main() and test() the last loop, nothing was said
    world, results = ranks
    rows = [r["evaluation_shapes"] for r in results]
    assert len(rows[0]["mnist_last"]) == 1, rows[0]
    text = rows[0]["mnist_last"][0]
    assert "TensorDataset (2500 samples in batches of 1000" in text
    assert f"each of the {world} processes" in text and "gather_for_metrics" in text
    assert rows[0]["mnist_raises"] == []  # left by an exception: no verdict
    assert all(row["mnist_last"] == [] for row in rows[1:])  # rank 0 only


def test_results_combined_through_files_or_a_users_own_group_are_not_warned_about(ranks):
    # issue 38: per-rank prediction files merged after wait_for_everyone(), and counts
    # all-reduced on the script's own new_group, were told they describe one rank's share
    _, results = ranks
    for row in (r["evaluation_shapes"] for r in results):
        assert row["files"] == [] and row["new_group"] == []


# ---- 6. batches made without a DataLoader -------------------------------------------------------------
def test_identical_batches_on_every_rank_are_warned_about_once(ranks):
    _, results = ranks
    first = results[0]["identical_inputs"]
    assert len(first["same_seed"]) == 1
    assert "split_between_processes" in first["same_seed"][0]
    assert "state().rank" in first["same_seed"][0]
    assert first["per_rank_seed"] == [] and first["loader"] == []
    assert all(r["identical_inputs"]["same_seed"] == [] for r in results[1:])


def test_shared_inputs_with_per_rank_targets_or_one_warm_up_step_are_not_the_same_inputs(ranks):
    # issue 38: both were told the ranks train identical copies
    _, results = ranks
    for r in results:
        assert r["identical_inputs"]["per_rank_targets"] == []
        assert r["identical_inputs"]["warm_up"] == []


# ---- 7. helper threads ---------------------------------------------------------------------------
def test_a_helper_thread_sees_its_ranks_real_coordinates(ranks):
    world, results = ranks
    for rank, result in enumerate(results):
        seen = result["helper_thread"]
        assert (seen["rank"], seen["world"]) == (rank, world)
        assert seen["scope"] is False  # the facts of its process, not the scopes of another thread
        assert seen["main"] is (rank == 0)
        assert seen["upload"] == ("uploaded" if rank == 0 else None)


# ---- 9. minGPT's trainer: a sampler of int(1e10) indices, next(data_iter) -----------------------
def test_mingpts_trainer_trains_each_rank_on_its_rounds_of_the_one_stream(ranks):
    # each rank takes its batch of each round of W (the sampler's order taken as it goes: the
    # worker fails if more is drawn than the steps need), and DDP keeps the replicas equal
    world, results = ranks
    for rank, result in enumerate(results):
        part = result["mingpt"]
        assert "error" not in part, part.get("error")
        assert part["rank"]["batches"] == part["stream"]["batches"][rank::world], f"rank {rank}"
        assert _equal(part["rank"]["weights"], results[0]["mingpt"]["rank"]["weights"])


def test_mingpts_trainer_in_one_process_takes_the_order_as_it_goes():
    from ..workers import mingpt

    plain = mingpt.train(12)
    with distributed():
        migrated = mingpt.train(12)  # the order of int(1e10) indices was taken whole here
    assert migrated["batches"] == plain["batches"]
    assert _equal(migrated["weights"], plain["weights"])


@pytest.mark.parametrize(("n", "size", "world", "said"), [
    (2500, 1000, 2, "rank 0: 1500 samples, rank 1: 2000 samples"),  # batch 0 again on rank 1
    (500, 1000, 2, "rank 0: 500 samples, rank 1: 500 samples"),  # one batch: a repeat
    (2500, 1000, 3, "rank 0: 1000 samples, rank 1: 1000 samples, rank 2: 500 samples"),
    (10, 2, 4, "rank 0: 4 samples, rank 1: 4 samples, rank 2: 4 samples, rank 3: 4 samples"),
])
def test_the_evaluation_warning_says_what_each_rank_saw(n, size, world, said):
    from torch.utils.data import DataLoader

    from accel_ctx._data import eval_passes as _eval_passes
    from accel_ctx._data.shard import ShardPlan

    loader = DataLoader(list(range(n)), batch_size=size)
    pending = _eval_passes.EvalPass(lambda: loader, _eval_passes.Loader.of(loader), "",
                                    ShardPlan(0, world), len(loader), 0, 0)
    assert _eval_passes._shares(pending) == said
