"""Mismatched and unusual collective calls, run inside each spawned rank (issue 11, points 5-6).

Each case records what the call did on this rank: the value it returned or the error it raised.
After every mismatch the next matching call must still work (the ranks stayed in step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from accel_ctx import (
    broadcast,
    broadcast_object,
    distributed,
    gather,
    gather_for_metrics,
    pad_across_processes,
    reduce,
    state,
)


def _outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    try:
        return {"value": fn()}
    except Exception as exc:  # the test looks at the type and the message
        return {"error": type(exc).__name__, "message": str(exc)}


def mismatches() -> dict[str, Any]:
    """Calls whose inputs do not fit together across the ranks, each followed by a good one."""
    out: dict[str, Any] = {}
    with distributed():
        rank, world = state().rank, state().world_size
        last = rank == world - 1  # the odd one out

        def check(name: str, fn: Callable[[], Any]) -> None:
            out[name] = _outcome(fn)
            out[name + "/after"] = _outcome(lambda: gather(torch.tensor([rank])).tolist())

        check("gather_shape", lambda: gather(torch.ones(2, 4 if last else 3)))
        check("gather_dtype", lambda: gather(torch.ones(2, dtype=torch.float64 if last
                                                         else torch.float32)))
        check("gather_keys", lambda: gather({"b" if last else "a": torch.ones(1)}))
        check("gather_count", lambda: gather([torch.ones(1)] * (2 if last else 1)))
        check("gather_ndim", lambda: gather(torch.tensor([1.0]) if last else torch.tensor(1.0)))
        check("gather_empty", lambda: gather(torch.empty(0) if last else torch.ones(2, 3)))
        check("gather_none", lambda: gather({"x": None if last else torch.ones(1)}))
        many = [torch.ones(1, 2) for _ in range(70)]
        if last:
            many[66] = torch.ones(1, 5)
        check("gather_many", lambda: gather(many))
        check("pad_shape", lambda: pad_across_processes(
            torch.ones(2, rank + 1, 1) if last else torch.ones(2, rank + 1), dim=1))
        check("reduce_shape", lambda: reduce(torch.ones(3, 2) if last else torch.ones(2, 3)))
        check("reduce_numel", lambda: reduce(torch.arange(8.0 if last else 6.0)))
        check("reduce_big", lambda: reduce(torch.ones(100_000 if last else 10)))
        check("reduce_count", lambda: reduce([torch.ones(2)] * (2 if last else 1), "max"))
        check("reduce_dtype", lambda: reduce(torch.ones(4, dtype=torch.float64 if last
                                                         else torch.float32), "min"))
        check("reduce_keys", lambda: reduce({"b" if last else "a": torch.ones(1)}, "mean"))
        check("reduce_large_same_numel", lambda: reduce(
            torch.ones(300, 2) if last else torch.ones(2, 300)))
        check("reduce_op", lambda: reduce(torch.ones(3), "max" if last else "sum"))
        check("reduce_op_mean", lambda: reduce(torch.ones(3), "sum" if last else "mean"))
        check("gather_vs_pad", lambda: pad_across_processes(torch.ones(2)) if last
              else gather(torch.ones(2)))
        check("broadcast_src", lambda: broadcast(torch.full((2,), float(rank)), src=rank))
        check("broadcast_object_src", lambda: broadcast_object({"r": rank}, src=rank))
        check("gather_unpicklable", lambda: gather([lambda: 0] if last else [rank]))
        check("broadcast_unpicklable", lambda: broadcast_object(lambda: 0, src=world - 1))
        check("metrics_keys", lambda: gather_for_metrics({"b" if last else "a": torch.ones(1)}))
        check("metrics_shape", lambda: gather_for_metrics(torch.ones(2, 2 if last else 3)))
    return out


def matching() -> dict[str, Any]:
    """Calls that fit together, with the unusual inputs a user passes (each case on its own)."""
    out: dict[str, Any] = {}
    with distributed():
        rank, world = state().rank, state().world_size
        huge = 2**62 // world + rank
        cases: dict[str, Callable[[], Any]] = {
            "numbers": lambda: gather([3 * rank + 1, 3 * rank + 2, 3 * rank + 3]),
            "strings": lambda: gather((f"a{rank}", f"b{rank}")),
            "value": lambda: gather(rank * 0.5),
            "mixed": lambda: gather({"loss": rank + 0.5, "ids": torch.arange(rank + 1),
                                     "names": [f"n{rank}"] * (rank + 1), "none": None}),
            "zero_rows": lambda: gather(torch.ones(0 if rank == 0 else rank, 3)),
            "many": lambda: gather([torch.full((rank + 1,), float(i)) for i in range(70)]),
            "pad_many": lambda: pad_across_processes([torch.ones(1, rank + 1)] * 65, dim=1),
            # an evaluation's last round: a shorter batch on rank 0 (Accelerate pads it too)
            "pad_last_batch": lambda: pad_across_processes(
                torch.full((1 if rank == 0 else 3, rank + 1), rank), dim=1, pad_index=-1),
            "pad_scalar": lambda: pad_across_processes(
                {"ids": torch.arange(rank + 1), "loss": torch.tensor(0.5 * rank)}),
            "reduce_numbers": lambda: reduce({"correct": rank + 5, "total": 10,
                                              "ok": rank == 0, "loss": 0.25 * rank}),
            "reduce_numbers_mean": lambda: reduce([rank, 2.0], "mean"),
            "reduce_float_precision": lambda: reduce({"x": 0.1 * (rank + 1)}),
            "reduce_string": lambda: reduce({"x": torch.ones(1), "tag": "train"}),
            "reduce_large": lambda: reduce(torch.arange(1000, dtype=torch.float32) * (rank + 1)),
            "reduce_int64_huge": lambda: reduce(torch.tensor([huge, 1])),
            "reduce_int64_huge_max": lambda: reduce(torch.tensor([2**60 + rank]), "max"),
            "reduce_mixed": lambda: reduce({"f": torch.full((2,), 1.5), "h": torch.ones(3).half(),
                                            "i": torch.tensor([rank], dtype=torch.int32),
                                            "b": torch.tensor([rank == 0])}, "sum"),
            "reduce_min": lambda: reduce(torch.tensor([float(rank), -float(rank)]), "min"),
            "reduce_float32": lambda: reduce(torch.tensor([0.1 * (rank + 1)]), "sum"),
            "broadcast_objects": lambda: broadcast({"t": torch.full((2,), float(rank)),
                                                    "name": f"r{rank}", "n": rank}, src=world - 1),
            "broadcast_object": lambda: broadcast_object([rank, "x"], src=world - 1),
            "metrics_value": lambda: gather_for_metrics({"loss": 0.5}),
        }
        for name, fn in cases.items():
            out[name] = _outcome(fn)
            out[name + "/after"] = _outcome(lambda: gather(torch.tensor([rank])).tolist())
    return out


class _Ids(Dataset[tuple[torch.Tensor, str]]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, str]:
        return torch.tensor(i), f"s{i}"


def sampler_metrics(n: int) -> dict[str, Any]:
    """gather_for_metrics over loaders the user sharded with a DistributedSampler."""
    out: dict[str, Any] = {}
    with distributed():
        rank, world = state().rank, state().world_size
        data = _Ids(n)
        cases = {
            "plain": (dict(shuffle=False), dict(batch_size=4)),
            "shuffled": (dict(shuffle=True, seed=3), dict(batch_size=5)),
            "one_batch": (dict(shuffle=False), dict(batch_size=n)),
            "loader_drop_last": (dict(shuffle=False), dict(batch_size=4, drop_last=True)),
            # 17 divides both 101/2 and 101/3 rounded up: the padded sample is in a full batch
            "loader_drop_last_full": (dict(shuffle=False), dict(batch_size=17, drop_last=True)),
            "sampler_drop_last": (dict(shuffle=False, drop_last=True), dict(batch_size=4)),
        }
        for name, (sampler_kw, loader_kw) in cases.items():
            sampler = DistributedSampler(data, num_replicas=world, rank=rank, **sampler_kw)
            ids: list[int] = []
            names: list[str] = []
            for x, s in DataLoader(data, sampler=sampler, **loader_kw):
                got_ids, got_names = gather_for_metrics((x, list(s)))
                ids += got_ids.tolist()
                names += got_names
            out[name] = {"ids": ids, "names": names,
                         "per_rank": sampler.num_samples, "batch": loader_kw["batch_size"]}
            out[name + "/after"] = gather(torch.tensor([rank])).tolist()
    return out


def matching_and_sampler(n: int) -> dict[str, Any]:
    return {"matching": matching(), "sampler": sampler_metrics(n)}
