"""Collective checks run inside each spawned rank: nested structures, uneven sizes, metrics."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

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
    state,
)
from accel_ctx._kernel.tree import map_tensors, to_device
from accel_ctx.errors import ConfigurationError


class Pair(NamedTuple):
    left: torch.Tensor
    right: torch.Tensor


@dataclass
class Output:
    logits: torch.Tensor
    extra: Any = None


def nested(rank: int) -> dict[str, Any]:
    """A structure whose tensors have rank + 1 rows (uneven across ranks)."""
    rows = rank + 1
    return {
        "x": torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) + 100 * rank,
        "pair": Pair(torch.full((rows,), rank), torch.tensor(float(rank))),
        "list": [Output(torch.ones(rows, 3, dtype=torch.bfloat16) * rank), None],
        "flags": torch.tensor([True] * rows),
    }


def collectives() -> dict[str, Any]:
    out: dict[str, Any] = {}
    with distributed():
        rank, world = state().rank, state().world_size
        tree = nested(rank)
        out["gather"] = gather(tree)
        out["gather_is_input"] = out["gather"] is tree
        out["gather_scalar"] = gather(torch.tensor(rank * 1.5))
        out["gather_zero_rows"] = gather(torch.ones(rank, 2) * rank)  # rank 0 has no rows
        out["gather_object"] = gather_object({"rank": rank, "name": f"r{rank}"})

        same: dict[str, Any] = {"v": torch.tensor([rank, -rank, 2 * rank], dtype=torch.float32),
                "n": (torch.tensor([rank + 1, 10]), torch.tensor(rank, dtype=torch.float64))}
        before = {"v": same["v"].clone(), "n0": same["n"][0].clone()}
        out["reduce"] = {op: reduce(same, op) for op in ("sum", "mean", "max", "min")}
        out["reduce_left_input"] = torch.equal(same["v"], before["v"]) and torch.equal(
            same["n"][0], before["n0"])

        src = world - 1  # the last rank sends, a structure with its own uneven sizes
        out["broadcast"] = broadcast(tree if rank == src else None, src=src)
        out["broadcast_own_shapes"] = broadcast(nested(rank), src=0)
        out["broadcast_object"] = broadcast_object({"seed": 1234 + rank}, src=src)

        ragged = {"ids": torch.arange(rank + 2).reshape(1, rank + 2) + 1,
                  "scalar": torch.tensor(5)}
        out["pad_end"] = pad_across_processes(ragged, dim=1, pad_index=-1)
        out["pad_first"] = pad_across_processes(ragged["ids"], dim=-1, pad_first=True)
        out["pad_gathered"] = gather(pad_across_processes(ragged["ids"], dim=1))

        items = list(range(10))
        out["split"] = split_between_processes(items)
        out["split_padded"] = split_between_processes(items, pad=True)
        out["split_tensor"] = split_between_processes(torch.arange(10), pad=True)
        out["split_dict"] = split_between_processes({"prompt": [f"p{i}" for i in range(7)],
                                                     "id": torch.arange(7)})
        out["split_roundtrip"] = gather(split_between_processes(torch.arange(10) * 3, pad=True))
        if world > 1:  # a value computed from a sharded parameter: refused, naming the fixes
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import Shard, distribute_tensor

            spread = distribute_tensor(torch.ones(2 * world, 2), init_device_mesh("cpu", (world,)),
                                       [Shard(0)]).sum()
            out["dtensor"] = [_refusal(lambda call=call: call({"norm": spread}))
                              for call in (reduce, gather)]
    return out


def _refusal(call: Callable[[], Any]) -> str:
    try:
        call()
    except ConfigurationError as exc:
        return str(exc)
    return "no error"


class Indexed(Dataset[tuple[torch.Tensor, str]]):
    """Samples that are an index tensor and a per-sample name (not a tensor)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, str]:
        return torch.tensor([float(i)]), f"sample-{i}"


class IndexStream(IterableDataset[torch.Tensor]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):  # type: ignore[no-untyped-def]
        return (torch.tensor(i) for i in range(self.n))

    def __len__(self) -> int:
        return self.n


class UnsizedStream(IterableDataset[torch.Tensor]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):  # type: ignore[no-untyped-def]
        return (torch.tensor(i) for i in range(self.n))


def metrics(n: int, batch_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with distributed():
        data = TensorDataset(torch.arange(n, dtype=torch.float32).unsqueeze(1), torch.arange(n))
        model = torch.nn.Linear(1, 1)
        with torch.no_grad():
            model.weight.fill_(2.0)
            model.bias.fill_(0.0)
        preds, labels = [], []
        with torch.no_grad():
            for x, y in DataLoader(data, batch_size=batch_size):
                p, t = gather_for_metrics((model(x).squeeze(1), y))
                preds.append(p)
                labels.append(t)
        out["map_preds"] = torch.cat(preds)
        out["map_labels"] = torch.cat(labels)

        for name, dataset in (("stream", IndexStream(n)), ("unsized", UnsizedStream(n))):
            seen = [gather_for_metrics(b) for b in DataLoader(dataset, batch_size=batch_size)]
            out[name] = torch.cat(seen)

        names: list[str] = []
        records: list[dict[str, Any]] = []
        for x, batch_names in DataLoader(Indexed(n), batch_size=batch_size):
            names += gather_for_metrics(batch_names)  # a list of strings: no tensor at all
            merged = gather_for_metrics({"index": x.squeeze(1).long(), "name": batch_names,
                                         "meta": [{"n": s} for s in batch_names]})
            records += [{"index": int(i), "name": s, "meta": m["n"]}
                        for i, s, m in zip(merged["index"], merged["name"], merged["meta"],
                                           strict=True)]
        out["names"] = names
        out["records"] = records

        torch.manual_seed(0)
        shuffled = [gather_for_metrics(y) for _, y in DataLoader(data, batch_size=batch_size,
                                                                  shuffle=True)]
        out["shuffled"] = torch.cat(shuffled)
    return out


def on_device(n: int, batch_size: int) -> dict[str, Any]:
    """The same collectives with tensors on this rank's device (NCCL on GPUs)."""
    devices: set[str] = set()

    def to_cpu(obj: Any) -> Any:
        def move(t: torch.Tensor) -> torch.Tensor:
            devices.add(t.device.type)
            return t.cpu()

        return map_tensors(obj, move)

    with distributed():
        rank, world, device = state().rank, state().world_size, state().device
        tree = to_device(nested(rank), device)
        out = {
            "gather": to_cpu(gather(tree)),
            "reduce": to_cpu(reduce({"v": torch.full((3,), float(rank), device=device)}, "max")),
            "broadcast": to_cpu(broadcast(tree if rank == world - 1 else None, src=world - 1)),
            "pad": to_cpu(pad_across_processes(torch.ones(1, rank + 1, device=device), dim=1)),
        }
    out["devices"] = sorted(devices)
    out["metrics"] = metrics(n, batch_size)  # batches arrive on the device
    return out


def run_all(n: int, batch_size: int) -> dict[str, Any]:
    return {"collectives": collectives(), "metrics": metrics(n, batch_size)}
