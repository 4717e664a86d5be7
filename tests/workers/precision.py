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
# "fp16-fused": GradScaler hands a fused AdamW the scale and the inf flag (no unscaling pass)
RUNS = ("bf16", "fp16", "fp16-fused")


def _optimizer(run: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if run.endswith("fused"):
        return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def _scoped(run: str) -> tuple[list[Any], list[dict[str, torch.Tensor]], float | None]:
    with distributed(), mixed_precision(run.split("-")[0]):  # type: ignore[arg-type]
        torch.manual_seed(0)
        model = MLP()
        opt = _optimizer(run, model)
        batches, history = [], []
        for x, y in DataLoader(make_data(), batch_size=8, shuffle=True):
            batches.append((x, y))
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            history.append(params(model))
        return batches, history, state().loss_scale


def _by_hand(run: str, batches: list[Any]) -> tuple[list[dict[str, torch.Tensor]], float]:
    policy = run.split("-")[0]
    torch.manual_seed(0)
    model = MLP()
    ddp = DistributedDataParallel(model)
    opt = _optimizer(run, model)
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


def compare(run: str) -> dict[str, Any]:
    batches, scoped, scale = _scoped(run)
    hand, hand_scale = by_hand(_by_hand, run, batches)
    return {"scoped": scoped, "hand": hand, "scale": scale, "hand_scale": hand_scale}


def run_all() -> dict[str, Any]:
    return {run: compare(run) for run in RUNS}
