"""Modules already under torch's composable replicate()/fully_shard() (issue 11, point 17)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed._composable.replicate import replicate
from torch.utils.data import DataLoader

from accel_ctx import distributed, state
from accel_ctx._engines import records as _records

from .common import MLP, make_data, params


def _train(apply: str) -> dict[str, Any]:
    with distributed():
        torch.manual_seed(0)
        model = MLP()
        if apply == "replicate":
            replicate(model)
        else:
            from torch.distributed.fsdp import fully_shard

            fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        engines = []
        for x, y in DataLoader(make_data(), batch_size=8, shuffle=True):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            record = _records.module_record(model)
            engines.append(None if record is None else type(record.engine).__name__)
        world = state().world_size
        if apply == "replicate":
            weights = params(model)
        else:  # gather the shards to compare whole weights
            weights = {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}
    return {"weights": weights, "engines": engines, "world": world,
            "class": type(model).__name__}


def _part() -> dict[str, Any]:
    """A model whose part is replicated: accel_ctx adopts neither the part nor the whole."""
    from accel_ctx._engines.adopt import composable_apis

    with distributed():
        torch.manual_seed(0)
        outer = torch.nn.Sequential(MLP())
        replicate(outer[0])
        x, y = make_data()[:8]
        F.cross_entropy(outer(x), y).backward()
        return {"apis": composable_apis(outer), "record": _records.module_record(outer) is not None,
                "grad": outer[0].net[0].weight.grad is not None}


def run(applies: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {apply: _train(apply) for apply in applies}
    out["part"] = _part()
    return out
