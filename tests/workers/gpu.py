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
