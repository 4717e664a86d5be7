"""Collectives on real processes (gloo, world sizes 1, 2, 3), and their single-process no-ops."""

from __future__ import annotations

import pytest
import torch

from accel_ctx import (
    broadcast,
    broadcast_object,
    distributed,
    gather,
    gather_for_metrics,
    gather_object,
    pad_across_processes,
    reduce,
    split_between_processes,
)
from accel_ctx.errors import ConfigurationError

from .._spawn import spawn
from ..workers import collectives
from ..workers.collectives import Output, Pair, nested

N, BATCH = 101, 8


@pytest.fixture(scope="module", params=[1, 2, 3], ids=["world1", "world2", "world3"])
def ranks(request, tmp_path_factory):
    world = request.param
    return world, spawn(collectives.run_all, world, tmp_path_factory.mktemp("coll"), N, BATCH)


def _same(a, b):
    """Equal values, types and dtypes, all the way down."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), (a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    elif isinstance(a, Output):
        _same(a.logits, b.logits)
        _same(a.extra, b.extra)
    else:
        assert a == b


def _expected_gather(world):
    # one rule for every world size (one process too): a 0-dim tensor becomes one row per rank
    parts = [nested(r) for r in range(world)]
    return {
        "x": torch.cat([p["x"] for p in parts]),
        "pair": Pair(torch.cat([p["pair"].left for p in parts]),
                     torch.stack([p["pair"].right for p in parts])),
        "list": [Output(torch.cat([p["list"][0].logits for p in parts])), None],
        "flags": torch.cat([p["flags"] for p in parts]),
    }


def test_gather_concatenates_uneven_nested_structures_in_rank_order(ranks):
    world, results = ranks
    for res in results:
        c = res["collectives"]
        _same(c["gather"], _expected_gather(world))
        scalars = torch.tensor([r * 1.5 for r in range(world)])
        _same(c["gather_scalar"], scalars)
        assert c["gather_zero_rows"].tolist() == [[r, r] for r in range(world) for _ in range(r)]
        assert c["gather_object"] == [{"rank": r, "name": f"r{r}"} for r in range(world)]
    assert results[0]["collectives"]["gather_is_input"] is False  # its 0-dim tensor: a row


def test_reduce_sums_averages_and_takes_extremes_without_touching_inputs(ranks):
    world, results = ranks
    r = torch.arange(world, dtype=torch.float64)
    for res in results:
        got = res["collectives"]["reduce"]
        assert res["collectives"]["reduce_left_input"]
        v = {op: got[op]["v"].double() for op in got}
        torch.testing.assert_close(v["sum"], torch.stack([r.sum(), -r.sum(), 2 * r.sum()]))
        torch.testing.assert_close(v["mean"], v["sum"] / world)
        torch.testing.assert_close(v["max"], torch.tensor([world - 1.0, 0.0, 2.0 * (world - 1)],
                                                          dtype=torch.float64))
        torch.testing.assert_close(v["min"], torch.tensor([0.0, 1.0 - world, 0.0],
                                                          dtype=torch.float64))
        counts, scalar = got["sum"]["n"]
        assert counts.tolist() == [int((r + 1).sum()), 10 * world] and counts.dtype == torch.int64
        assert scalar.dtype == torch.float64 and float(scalar) == float(r.sum())
        mean_counts = got["mean"]["n"][0]
        torch.testing.assert_close(mean_counts.double(), counts.double() / world)
        assert type(got["sum"]["n"]) is tuple


def test_a_dtensor_is_refused_naming_its_whole_value_and_this_ranks_part(ranks):
    # it failed inside torch (.tolist() of a DTensor, an all_gather with no sharding
    # strategy), and each rank blamed the other
    world, results = ranks
    if world == 1:
        pytest.skip("one process: the input comes back as it is")
    for res in results:
        for message in res["collectives"]["dtensor"]:
            assert "DTensor at ['norm']" in message, message
            assert "full_tensor()" in message and "to_local()" in message


def test_broadcast_sends_the_source_structure_with_its_own_sizes(ranks):
    world, results = ranks
    for res in results:
        c = res["collectives"]
        _same(c["broadcast"], nested(world - 1))
        _same(c["broadcast_own_shapes"], nested(0))
        assert c["broadcast_object"] == {"seed": 1234 + world - 1}


def test_pad_across_processes(ranks):
    world, results = ranks
    for rank, res in enumerate(results):
        c = res["collectives"]
        ids = torch.arange(rank + 2) + 1
        fill = world + 1 - (rank + 2)
        assert c["pad_end"]["ids"].tolist() == [ids.tolist() + [-1] * fill]
        assert c["pad_end"]["scalar"].tolist() == 5  # nothing to pad along dim 1
        assert c["pad_first"].tolist() == [[0] * fill + ids.tolist()]
        assert c["pad_gathered"].shape == (world, world + 1)


def test_split_between_processes_gives_contiguous_parts(ranks):
    world, results = ranks
    k = -(-10 // world)
    items = list(range(10))
    for rank, res in enumerate(results):
        c = res["collectives"]
        mine = items[rank * k:(rank + 1) * k]
        assert c["split"] == mine
        assert c["split_padded"] == mine + [9] * (k - len(mine))
        assert c["split_tensor"].tolist() == c["split_padded"]
        k7 = -(-7 // world)
        assert c["split_dict"]["prompt"] == [f"p{i}" for i in range(7)][rank * k7:(rank + 1) * k7]
        assert c["split_dict"]["id"].tolist() == list(range(7))[rank * k7:(rank + 1) * k7]
        assert c["split_roundtrip"][:10].tolist() == [3 * i for i in range(10)]
    assert [i for res in results for i in res["collectives"]["split"]] == items


def test_gather_for_metrics_sees_each_sample_once_in_order(ranks):
    _, results = ranks
    for res in results:
        m = res["metrics"]
        assert m["map_preds"].tolist() == [2.0 * i for i in range(N)]
        assert m["map_labels"].tolist() == list(range(N))
        assert m["stream"].tolist() == list(range(N))  # IterableDataset with a length
        assert m["unsized"].tolist() == list(range(N))  # and without one
        assert m["names"] == [f"sample-{i}" for i in range(N)]  # non-tensor objects
        assert m["records"] == [{"index": i, "name": f"sample-{i}", "meta": f"sample-{i}"}
                                for i in range(N)]
        assert sorted(m["shuffled"].tolist()) == list(range(N))
        assert torch.equal(m["shuffled"], results[0]["metrics"]["shuffled"])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL collectives need 2 GPUs")
def test_collectives_over_nccl_on_gpus(tmp_path):
    results = spawn(collectives.on_device, 2, tmp_path, N, BATCH)
    for res in results:
        assert res["devices"] == ["cuda"]  # results stay on the device
        _same(res["gather"], _expected_gather(2))
        assert res["reduce"]["v"].tolist() == [1.0] * 3
        _same(res["broadcast"], nested(1))
        assert res["pad"].shape == (1, 2)
        assert res["metrics"]["map_preds"].cpu().tolist() == [2.0 * i for i in range(N)]


# ---- single process -----------------------------------------------------------------------------
@pytest.mark.parametrize("inside", [False, True], ids=["outside", "distributed"])
def test_single_process_returns_the_input_itself(inside):
    tree = {"a": torch.ones(2), "b": [torch.zeros(3, 1), None]}
    with distributed() if inside else _nothing():
        assert gather(tree) is tree
        assert reduce(tree, "mean") is tree
        assert broadcast(tree) is tree
        assert pad_across_processes(tree) is tree
        assert gather_for_metrics(tree) is tree
        assert broadcast_object(tree) is tree
        assert gather_object(tree) == [tree] and gather_object(tree)[0] is tree
        items = [1, 2, 3]
        assert split_between_processes(items, pad=True) is items
        # the rule of many ranks: a bare value is one entry per rank, a 0-dim tensor one row
        assert gather(5) == [5] and gather("a") == ["a"] and gather(items) is items
        assert gather(torch.tensor(2.0)).tolist() == [2.0]
        assert gather({"n": 3, "t": torch.ones(2)})["n"] == [3]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def test_arguments_are_checked_with_the_fix():
    with pytest.raises(ConfigurationError, match="'sum', 'mean', 'max', 'min'"):
        reduce(torch.ones(1), "avg")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="only rank 0"):
        broadcast(torch.ones(1), src=1)
    with pytest.raises(ConfigurationError, match="only rank 0"):
        broadcast_object(1, src=2)
