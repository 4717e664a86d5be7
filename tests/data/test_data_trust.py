"""Issue 11, points 1, 2 and 11: drop_last per round, the sampler's generators, uneven batches.

One spawn per world size (2 and 3, gloo) runs every check; the references are real: one
process with batch W*b for the data, hand-written DDP + Join for uneven training.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler

from accel_ctx import distributed, load_state, save_state
from accel_ctx._data.order import fingerprint
from accel_ctx._data.shard import ShardedIndices, ShardPlan

from .._spawn import spawn
from ..workers import data_trust

BATCH = 4
N_DROP = 46  # 11 batches of 4 (+ 2 samples): an incomplete round on 2 and on 3 ranks
N_GEN = 24  # 6 batches of 4: whole rounds on 2 and 3 ranks, no padding
N_UNEVEN = 42  # 11 batches: ranks get 6/5 (W=2) and 4/4/3 (W=3)


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def ranks(request: Any, tmp_path_factory: Any) -> tuple[int, list[dict[str, Any]]]:
    world = request.param
    results = spawn(data_trust.run_all, world, tmp_path_factory.mktemp("data"), BATCH, N_DROP,
                    N_GEN, N_UNEVEN, timeout=300.0)
    return world, results


def _section(results: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    out = [r[name] for r in results]
    for rank, part in enumerate(out):
        assert "error" not in part, f"rank {rank}:\n{part['error']}"
    return out


def _rounds(per_rank: list[list[list[int]]]) -> list[list[int]]:
    """Round k of an epoch: the ranks' k-th batches, concatenated in rank order."""
    assert len({len(batches) for batches in per_rank}) == 1, [len(b) for b in per_rank]
    return [[i for batches in per_rank for i in batches[k]] for k in range(len(per_rank[0]))]


def _same_as_one_process(per_rank: list[Any], reference: Any) -> None:
    """Every epoch: W ranks' rounds are the reference's batches (same samples, same order)."""
    for epoch, expected in enumerate(reference):
        assert _rounds([r[epoch] for r in per_rank]) == expected, f"epoch {epoch}"


def _allclose(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


# ---- point 1: drop_last ------------------------------------------------------------------------
def test_drop_last_gives_the_batches_of_one_process_with_the_whole_batch(ranks):
    world, results = ranks
    reference = data_trust.drop_sections(BATCH * world, N_DROP)
    for section in ("loaders", "uneven"):  # even_batches=False too: drop_last wins
        parts = [p[section] for p in _section(results, "drop_last")]
        for kind in ("map", "stream", "batch_sampler"):
            _same_as_one_process([p[kind] for p in parts], reference[kind])
        for kind in ("map_len", "stream_len", "batch_sampler_len"):
            assert [p[kind] for p in parts] == [reference[kind]] * world, kind
    assert reference["map_len"] == (N_DROP // BATCH) // world  # the incomplete round is gone


def test_drop_last_training_with_accumulation_equals_one_process(ranks):
    world, results = ranks
    weights, steps = data_trust.drop_training(BATCH * world, N_DROP)
    for part in _section(results, "drop_last"):
        _allclose(part["trained"][0], weights)
        assert part["trained"][1] == steps


def test_drop_last_checkpoint_at_an_epoch_end_resumes_with_the_next_epoch(ranks):
    _, results = ranks
    for part in _section(results, "drop_last"):
        assert part["resume"]["resumed"] == part["resume"]["straight"]
        assert part["resume"]["resumed"]  # a real epoch, not an empty replay


# ---- point 2: the sampler's generators ----------------------------------------------------------
def test_generators_the_sampler_holds_are_shared_by_the_ranks(ranks):
    world, results = ranks
    reference = data_trust.generator_sections(0, BATCH * world, N_GEN)  # rank 0's seeds
    parts = [p["loaders"] for p in _section(results, "generators")]
    for kind, expected in reference.items():
        _same_as_one_process([p[kind] for p in parts], expected)


def test_loader_workers_take_their_seed_from_their_own_ranks_stream(ranks):
    """Seeded apart, each rank's workers get the base seed that rank draws alone (as under
    torchrun + DDP), not rank 0's, while the order still comes from rank 0's state."""
    world, results = ranks
    parts = _section(results, "generators")
    for kind in ("started", "persistent"):  # workers started each epoch, or kept (reset)
        for rank, part in enumerate(parts):
            mine, alone = part["worker_seeds"][kind], part["worker_seeds_alone"][kind]
            assert (mine["seeds"], mine["next"]) == (alone["seeds"], alone["next"]), (kind, rank)
        seeds = [part["worker_seeds"][kind]["seeds"] for part in parts]
        assert all(len(epoch) == 2 for rank_seeds in seeds for epoch in rank_seeds)  # 2 workers
        assert len({repr(s) for s in seeds}) == world  # no two ranks share their workers' seeds
        # the ranks' shares of each epoch: every sample once
        for epoch in range(2):
            ids = sorted(i for p in parts for b in p["worker_seeds"][kind]["ids"][epoch] for i in b)
            assert ids == list(range(N_GEN)), (kind, epoch)


@pytest.mark.parametrize("kind", ["python_random", "numpy", "stream"])
def test_a_sampler_drawing_from_an_unreachable_rng_is_refused(ranks, kind):
    _, results = ranks
    parts = [p[kind] for p in _section(results, "generators")]
    assert parts[0]["raised"] is None  # rank 0 is the reference order
    for rank, part in enumerate(parts[1:], start=1):
        message = part["raised"]
        assert message is not None and message.startswith("DistributedError"), (rank, part)
        assert f"rank {rank}" in message and "torch.Generator" in message
        if kind == "stream":  # a stream may also split itself between the ranks: say both fixes
            assert "different batch" in message and "splits itself" in message
            assert "DistributedSampler" not in message  # no sampler to give a stream
        else:
            assert "different order" in message
    # rank 0 learns it at its next sync point, naming a rank that refused
    assert re.search(r"rank [1-9]\d* left distributed\(\) with DistributedError", parts[0]["after"])


# ---- point 11: even_batches=False with training ------------------------------------------------
def test_uneven_batches_train_like_ddp_with_join_written_by_hand(ranks):
    _, results = ranks
    parts = _section(results, "uneven")
    for part in parts:
        _allclose(part["trained"], part["hand"])
        _allclose(part["trained_stream"], part["hand_stream"])
    for part in parts[1:]:  # Join's last step hands every rank the same model
        _allclose(part["trained"], parts[0]["trained"])


def test_uneven_evaluation_and_accumulation_finish_on_every_rank(ranks):
    _, results = ranks
    parts = _section(results, "uneven")
    for part in parts:
        assert part["eval_seen"] == N_UNEVEN
        assert "error" not in (part["accumulated"] or {})
        _allclose(part["accumulated"], parts[0]["accumulated"])


def test_uneven_gather_for_metrics_sees_every_sample_once(ranks):
    _, results = ranks
    parts = _section(results, "uneven")
    main = parts[0]  # rank 0 always gets a batch of the incomplete round
    assert main["gathered"] == list(range(N_UNEVEN))
    assert main["gathered_names"] == [f"s{i}" for i in range(N_UNEVEN)]
    targets = sorted(data_trust.make_data(N_UNEVEN).tensors[1].tolist())
    assert sorted(main["trained_gathered"]) == sorted(targets * 2)  # two epochs, no padding
    for part in parts:  # gathering in the loop changes nothing in the training
        _allclose(part["trained_gathering"], part["hand"])


def test_an_uneven_first_epoch_of_one_whole_round_trains_like_join_by_hand(ranks):
    # W+1 batches: the first step's inputs check met the ranks at the second step, which the
    # ranks with one batch never reach (they waited in Join), and the job hung
    _, results = ranks
    for part in _section(results, "uneven"):
        assert "error" not in part["one_round"], part["one_round"]["error"]
        _allclose(part["one_round"], part["one_round_hand"])


def test_uneven_batches_with_two_trained_models_are_refused_on_every_rank(ranks):
    _, results = ranks
    for part in _section(results, "uneven"):
        assert "ConfigurationError" in part["two_models"]["error"]
        assert "even_batches=True" in part["two_models"]["error"]


def test_fewer_batches_than_ranks_in_training_is_refused_not_a_hang(ranks):
    _, results = ranks
    parts = [p["too_few"] for p in _section(results, "uneven")]
    assert parts[0]["raised"] is not None and "even_batches=True" in parts[0]["raised"], parts
    for part in parts[1:]:
        assert part["raised"] is None and "rank 0 left distributed()" in part["after"], parts


# ---- the rules themselves, without processes ----------------------------------------------------
def _shares(total: int, world: int, **plan: Any) -> list[list[int]]:
    return [list(ShardedIndices(range(total), ShardPlan(r, world, **plan))) for r in range(world)]


@pytest.mark.parametrize("total", [0, 1, 5, 7, 12])
@pytest.mark.parametrize("world", [2, 3])
def test_drop_keeps_complete_rounds_only(total, world):
    for even in (True, False):
        shares = _shares(total, world, even=even, drop=True)
        rounds = total // world
        assert [len(s) for s in shares] == [rounds] * world
        assert sorted(i for share in shares for i in share) == list(range(rounds * world))
        assert ShardPlan(0, world, even, 0, True).share(total) == rounds


def test_uneven_rounds_mark_the_tail_before_it_is_handed_out():
    world, total = 3, 7
    sharded = [ShardedIndices(range(total), ShardPlan(r, world, even=False)) for r in range(world)]
    first = [next(s) for s in sharded]
    assert first == [0, 1, 2] and all(s.tail_start is None for s in sharded)
    assert [next(s) for s in sharded] == [3, 4, 5]
    assert next(sharded[0]) == 6 and sharded[0].tail_start == 2 and sharded[0].incomplete
    for s in sharded[1:]:
        with pytest.raises(StopIteration):
            next(s)
        assert s.incomplete and s.tail_start is None


def test_drop_resumed_epoch_ends_at_its_last_complete_round():
    plan = ShardPlan(1, 2, True, 4, True)
    assert list(ShardedIndices(range(11), plan)) == [5, 7, 9]
    assert plan.end(11) == 10 and plan.share(11) == 3


def test_fingerprint_tells_orders_apart_and_is_stable():
    assert fingerprint([1, 2, 3]) == fingerprint([1, 2, 3]) != fingerprint([3, 2, 1])
    a = torch.arange(12.0).reshape(3, 4)
    assert fingerprint((a, [1, "x"])) == fingerprint((a.clone(), [1, "x"]))
    assert fingerprint(a) != fingerprint(a.flip(0))
    assert fingerprint(torch.tensor([1, 2])) != fingerprint(torch.tensor([1.0, 2.0]))

    class Opaque:
        pass

    assert fingerprint([Opaque()]) == fingerprint([Opaque()])  # never an invented difference


def test_resume_mid_epoch_replays_the_order_of_the_generator_the_sampler_holds(tmp_path):
    """The epoch's start states include the sampler's own generator (saved with checkpoints)."""

    def make() -> DataLoader[Any]:
        g = torch.Generator().manual_seed(7)
        return DataLoader(data_trust.LoggingDataset(20), batch_size=2,
                          sampler=RandomSampler(range(20), generator=g))

    with distributed():
        loader = make()
        first_epoch = [b[0].tolist() for b in loader]
        it = iter(loader)
        for _ in range(3):
            next(it)
        save_state(tmp_path, loader=loader)
        rest = [b[0].tolist() for b in it]
    assert rest and sorted(i for b in first_epoch for i in b) == list(range(20))
    with distributed():
        loader = make()  # its generator is back at the first epoch's state
        load_state(tmp_path, loader=loader)
        assert [b[0].tolist() for b in loader] == rest
