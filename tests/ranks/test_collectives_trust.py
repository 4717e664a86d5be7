"""Issue 11, points 5 and 6: collectives never hang, abort or return a value from a mismatched
call, and they gather Python data and DistributedSampler batches the way a user expects.

Real processes (gloo, worlds of 2 and 3); many checks per spawn.
"""

from __future__ import annotations

import pytest
import torch

from .._spawn import spawn
from ..workers import collectives_trust

N = 101

# case -> what every rank's message must show (each rank's shape, dtype or keys)
GATHER_CASES = {
    "gather_shape": ["rank 0 has (2, 3) float32", "has (2, 4) float32"],
    "gather_dtype": ["rank 0 has (2,) float32", "has (2,) float64"],
    "gather_keys": ["rank 0 has a dict with keys ['a']", "has a dict with keys ['b']"],
    "gather_count": ["rank 0 has a list of 1", "has a list of 2"],
    "gather_ndim": ["rank 0 has () float32", "has (1,) float32"],
    "gather_empty": ["rank 0 has (2, 3) float32", "has (0,) float32"],
    "gather_none": ["at ['x'], rank 0 has (1,) float32", "has None"],
    "gather_many": ["at [66], rank 0 has (1, 2) float32", "has (1, 5) float32"],
    "pad_shape": ["rank 0 has (2, 1) float32", "has (2, "],
    "metrics_keys": ["rank 0 has a dict with keys ['a']", "has a dict with keys ['b']"],
    "metrics_shape": ["rank 0 has (2, 3) float32", "has (2, 2) float32"],
}
REDUCE_CASES = {
    "reduce_shape": ["rank 0 has (2, 3) float32", "has (3, 2) float32"],
    "reduce_numel": ["rank 0 has (6,) float32", "has (8,) float32"],
    "reduce_big": ["rank 0 has (10,) float32", "has (100000,) float32"],
    "reduce_count": ["rank 0 has a list of 1", "has a list of 2"],
    "reduce_dtype": ["rank 0 has (4,) float32", "has (4,) float64"],
    "reduce_keys": ["rank 0 has a dict with keys ['a']", "has a dict with keys ['b']"],
    "reduce_large_same_numel": ["rank 0 has (2, 300) float32", "has (300, 2) float32"],
}


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def mismatched(request, tmp_path_factory):
    world = request.param
    return world, spawn(collectives_trust.mismatches, world, tmp_path_factory.mktemp("mis"),
                        timeout=300)  # generous: a loaded CI machine, never a hang


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def matched(request, tmp_path_factory):
    world = request.param
    return world, spawn(collectives_trust.matching_and_sampler, world,
                        tmp_path_factory.mktemp("match"), N, timeout=300)


def _raised_everywhere(world, results, case, call, shows):
    for rank, res in enumerate(results):
        got = res[case]
        assert got.get("error") == "DistributedError", (case, rank, got)
        message = got["message"]
        assert message.startswith(f"rank {rank}: {call}"), message
        assert "No rank got a result" in message or "no rank got a value" in message, message
        for text in shows:
            assert text in message, (case, text, message)
        assert f"rank {world - 1} has" in message or "src=" in message, message
        # the ranks stayed in step: the next matching call works
        assert res[case + "/after"] == {"value": list(range(world))}, (case, rank)


def test_mismatched_gathers_and_pads_raise_on_every_rank_naming_each_shape(mismatched):
    world, results = mismatched
    for case, shows in GATHER_CASES.items():
        call = ("gather_for_metrics()" if case.startswith("metrics") else
                "pad_across_processes(dim=1)" if case.startswith("pad") else "gather()")
        _raised_everywhere(world, results, case, call, shows)


def test_mismatched_reduces_raise_on_every_rank_and_none_returns_or_aborts(mismatched):
    world, results = mismatched
    for case, shows in REDUCE_CASES.items():
        op = {"reduce_count": "max", "reduce_dtype": "min", "reduce_keys": "mean"}.get(case, "sum")
        _raised_everywhere(world, results, case, f"reduce(op={op!r})", shows)


def test_ranks_in_different_calls_raise_on_every_rank(mismatched):
    world, results = mismatched
    last = world - 1
    for case, calls in (("reduce_op", ["reduce(op='sum')", "reduce(op='max')"]),
                        ("reduce_op_mean", ["reduce(op='mean')", "reduce(op='sum')"]),
                        ("gather_vs_pad", ["gather()", "pad_across_processes(dim=0)"])):
        shows = ["different calls", f"rank 0: {calls[0]}", f"rank {last}: {calls[1]}"]
        for rank, res in enumerate(results):
            assert res[case].get("error") == "DistributedError", (case, rank, res[case])
            for text in shows:
                assert text in res[case]["message"], (case, text, res[case]["message"])
            assert res[case + "/after"] == {"value": list(range(world))}, (case, rank)


def test_broadcasts_from_disagreeing_sources_raise_on_every_rank(mismatched):
    world, results = mismatched
    for call in ("broadcast", "broadcast_object"):
        case = call + "_src"
        srcs = [f"rank {r}: {call}(src={r})" for r in range(world)]
        _raised_everywhere(world, results, case, call + "()", srcs)


def _values(world, res):
    """Each case's value on this rank; every case must have left the ranks in step."""
    got = {}
    for name, outcome in res["matching"].items():
        if name.endswith("/after"):
            assert outcome == {"value": list(range(world))}, name
        else:
            got[name] = outcome.get("value", outcome)
    return got


def test_unpicklable_python_data_raises_on_every_rank(mismatched):
    world, results = mismatched
    for res in results:
        for case, text in (("gather_unpicklable", f"gather(): rank(s) [{world - 1}] could not"),
                           ("broadcast_unpicklable", f"rank {world - 1} could not pickle")):
            assert res[case].get("error") == "ConfigurationError", (case, res[case])
            assert text in res[case]["message"], res[case]["message"]
            assert res[case + "/after"] == {"value": list(range(world))}, case


def test_gather_gathers_python_data_like_tensors(matched):
    world, results = matched
    for rank, res in enumerate(results):
        m = _values(world, res)
        assert m["numbers"] == list(range(1, 3 * world + 1))  # lists of numbers: concatenated
        assert m["strings"] == tuple(s for r in range(world) for s in (f"a{r}", f"b{r}"))
        assert m["value"] == [r * 0.5 for r in range(world)]  # a bare value: one per rank
        mixed = m["mixed"]
        assert mixed["loss"] == [r + 0.5 for r in range(world)]
        assert mixed["ids"].tolist() == [i for r in range(world) for i in range(r + 1)]
        assert mixed["names"] == [f"n{r}" for r in range(world) for _ in range(r + 1)]
        assert mixed["none"] is None
        assert m["zero_rows"].shape == (sum(range(world)), 3)
        assert len(m["many"]) == 70  # more tensors than the header carries inline
        assert all(t.tolist() == [float(i)] * sum(range(1, world + 1))
                   for i, t in enumerate(m["many"]))
        assert len(m["pad_many"]) == 65 and all(
            p.tolist() == [[1.0] * (rank + 1) + [0.0] * (world - rank - 1)]
            for p in m["pad_many"])
        # only dim 1 is padded: each rank's own number of rows stays
        assert m["pad_last_batch"].tolist() == [
            [rank] * (rank + 1) + [-1] * (world - rank - 1)] * (1 if rank == 0 else 3)
        assert m["pad_scalar"]["ids"].tolist() == list(range(rank + 1)) + [0] * (world - rank - 1)
        assert m["pad_scalar"]["loss"].shape == () and m["pad_scalar"]["loss"].item() == 0.5 * rank
        assert m["metrics_value"]["error"] == "ConfigurationError"
        assert "gather() / gather_object()" in m["metrics_value"]["message"]


def test_reduce_combines_numbers_mixed_dtypes_and_huge_integers_exactly(matched):
    world, results = matched
    ranks = range(world)
    for res in results:
        m = _values(world, res)
        numbers = m["reduce_numbers"]
        assert numbers == {"correct": sum(r + 5 for r in ranks), "total": 10 * world,
                           "ok": True, "loss": sum(0.25 * r for r in ranks)}
        assert type(numbers["correct"]) is int and type(numbers["ok"]) is bool
        assert m["reduce_numbers_mean"] == [sum(ranks) / world, 2.0]
        precise = m["reduce_float_precision"]["x"]  # summed in float64, not float32
        assert type(precise) is float and abs(precise - sum(0.1 * (r + 1) for r in ranks)) < 1e-12
        assert m["reduce_string"]["error"] == "ConfigurationError"
        assert "cannot combine at ['tag']" in m["reduce_string"]["message"]
        expected = torch.arange(1000, dtype=torch.float32) * sum(r + 1 for r in ranks)
        assert torch.equal(m["reduce_large"], expected)  # beyond the inline slots
        huge = 2**62 // world
        assert m["reduce_int64_huge"].tolist() == [huge * world + sum(ranks), world]
        assert m["reduce_int64_huge_max"].tolist() == [2**60 + world - 1]
        mixed = m["reduce_mixed"]
        assert mixed["f"].dtype == torch.float32 and mixed["f"].tolist() == [1.5 * world] * 2
        assert mixed["h"].dtype == torch.float16 and mixed["h"].tolist() == [float(world)] * 3
        assert mixed["i"].dtype == torch.int32 and mixed["i"].tolist() == [sum(ranks)]
        assert mixed["b"].dtype == torch.bool and mixed["b"].tolist() == [True]
        assert m["reduce_min"].tolist() == [0.0, -(world - 1.0)]
        exact = sum(float(torch.tensor(0.1 * (r + 1))) for r in ranks)
        assert m["reduce_float32"].dtype == torch.float32
        torch.testing.assert_close(m["reduce_float32"], torch.tensor([exact], dtype=torch.float32))
        assert m["broadcast_objects"]["name"] == f"r{world - 1}"
        assert m["broadcast_objects"]["n"] == world - 1
        assert m["broadcast_objects"]["t"].tolist() == [world - 1.0] * 2
        assert m["broadcast_object"] == [world - 1, "x"]


def test_gather_for_metrics_drops_distributed_sampler_padding(matched):
    world, results = matched
    for res in results:
        s = res["sampler"]
        for case in ("plain", "shuffled", "one_batch", "loader_drop_last_full"):
            ids = s[case]["ids"]
            assert sorted(ids) == list(range(N)), (case, len(ids))  # each sample once
            assert s[case]["names"] == [f"s{i}" for i in ids], case  # lists trimmed alike
        per_rank, batch = s["loader_drop_last"]["per_rank"], s["loader_drop_last"]["batch"]
        kept = s["loader_drop_last"]["ids"]  # the incomplete last batches were dropped
        assert len(kept) == len(set(kept)) == world * (per_rank // batch * batch)
        dropped = s["sampler_drop_last"]  # DistributedSampler(drop_last=True): no padding
        assert sorted(dropped["ids"]) == list(range(world * dropped["per_rank"]))
        assert all(s[k] == list(range(world)) for k in s if k.endswith("/after"))
    assert results[0]["sampler"] == results[-1]["sampler"]
