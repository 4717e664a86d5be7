"""Checks run on real ranks with CUDA devices (NCCL)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from accel_ctx import distributed, state

from .common import params, train


def nccl_checks() -> dict[str, Any]:
    out: dict[str, Any] = {}
    with distributed():
        out["backend"] = state().backend
        out["mlp"] = params(train("mlp", 8))
    with distributed(sync_batchnorm=True):
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        model(torch.randn(8, 4) + state().rank).sum().backward()
        out["bn_mean"] = model[1].running_mean.cpu()
    out["bn_class_after"] = type(model[1]).__name__
    return out


def tensor_parallel_on_two_gpus(batch: int) -> dict[str, Any]:
    """distributed(tp=2) on two GPUs (NCCL): the TP path's DTensors, autocast and the optimizers'
    CUDA defaults (foreach: split and plain parameters in one list) on CUDA."""
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from accel_ctx import mixed_precision

    from .sharded import full_weights, tokens
    from .tensor_parallel import GPT, PLAN, make_optimizer

    out: dict[str, Any] = {}
    for precision in ("no", "bf16"):
        with distributed(tp=2, tp_plan=PLAN), mixed_precision(precision):
            torch.manual_seed(0)
            model = GPT()
            opt = make_optimizer(model, "sgd")
            losses = []
            for x, y in DataLoader(tokens(32), batch_size=batch, shuffle=True):
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            out[precision] = {
                "weights": full_weights(model), "losses": losses,
                "split": type(model.layers[0].attn.q.weight).__name__,
                "devices": sorted({str(p.device) for p in model.parameters()}),
                "tp": (state().tp_rank, state().tp_size)}
    return out
