"""Mixed precision on real ranks: the scoped loop versus DDP + autocast + GradScaler by hand."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from accel_ctx import distributed, mixed_precision, state

from .common import MLP, by_hand, make_data, params

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _scoped(policy: str) -> tuple[list[Any], list[dict[str, torch.Tensor]], float | None]:
    with distributed(), mixed_precision(policy):
        torch.manual_seed(0)
        model = MLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        batches, history = [], []
        for x, y in DataLoader(make_data(), batch_size=8, shuffle=True):
            batches.append((x, y))
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            history.append(params(model))
        return batches, history, state().loss_scale


def _by_hand(policy: str, batches: list[Any]) -> tuple[list[dict[str, torch.Tensor]], float]:
    torch.manual_seed(0)
    model = MLP()
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", enabled=policy == "fp16")
    history = []
    for x, y in batches:
        with torch.autocast("cpu", dtype=DTYPES[policy]):
            out = ddp(x)
        scaler.scale(F.cross_entropy(out.float(), y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        history.append(params(model))
    return history, scaler.get_scale()


def compare(policy: str) -> dict[str, Any]:
    batches, scoped, scale = _scoped(policy)
    hand, hand_scale = by_hand(_by_hand, policy, batches)
    return {"scoped": scoped, "hand": hand, "scale": scale, "hand_scale": hand_scale}


def run_all() -> dict[str, Any]:
    return {policy: compare(policy) for policy in ("bf16", "fp16")}
