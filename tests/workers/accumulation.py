"""Gradient accumulation on real ranks."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.utils.data import DataLoader, TensorDataset

from accel_ctx import accumulate, distributed, mixed_precision, no_sync, state
from accel_ctx._engines import records as _records

from .common import MLP, make_data, params


def train_accumulating(n: int, batch: int, steps: int, epochs: int = 2) -> dict[str, Any]:
    """The plain loop under accumulate(steps); counts all-reduces with a DDP comm hook."""
    allreduces = [0]
    sync_flags = []
    with distributed(), accumulate(steps):
        torch.manual_seed(0)
        model = MLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        loader = DataLoader(make_data(n), batch_size=batch, shuffle=True)
        hooked = False
        for _ in range(epochs):
            for x, y in loader:
                out = model(x)
                if not hooked:
                    engine = _records.module_record(model).engine  # type: ignore[union-attr]

                    def count(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
                        allreduces[0] += 1
                        return allreduce_hook(None, bucket)

                    engine.register_comm_hook(None, count)
                    hooked = True
                F.cross_entropy(out, y).backward()
                sync_flags.append(state().sync_gradients)
                opt.step()
                sched.step()
                opt.zero_grad()
        steps_taken = state().step
    return {
        "params": params(model),
        "allreduces": allreduces[0],
        "steps": steps_taken,
        "sync_flags": sync_flags,
        "lr": opt.param_groups[0]["lr"],
    }


def fp16_group_skip() -> dict[str, Any]:
    """An inf in one micro-batch drops its whole group."""
    with distributed(), mixed_precision("fp16", init_scale=1024.0), accumulate(2):
        torch.manual_seed(0)
        model = MLP()
        calls = [0]

        def poison(grad: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            return torch.full_like(grad, float("inf")) if calls[0] == 3 else grad

        model.net[2].weight.register_hook(poison)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        history, scales = [], []
        for x, y in DataLoader(make_data(40), batch_size=4):
            F.cross_entropy(model(x), y).backward()
            scales.append(state().loss_scale)  # the scale this backward used
            opt.step()
            opt.zero_grad()
            history.append(params(model))
        return {"history": history, "skipped": state().skipped_steps, "steps": state().step,
                "scales": scales}


def manual_no_sync() -> dict[str, Any]:
    """no_sync(): gradients stay local until the first backward outside it."""
    with distributed():
        torch.manual_seed(0)
        model = MLP()
        x = torch.randn(4, 8) + state().rank
        model.zero_grad()
        with no_sync():
            model(x).sum().backward()
        local = model.net[0].weight.grad.clone()  # type: ignore[union-attr]
        model(x).sum().backward()
        synced = model.net[0].weight.grad.clone()  # type: ignore[union-attr]
    return {"local": local, "synced": synced}


def run_all() -> dict[str, Any]:
    return {
        "even": train_accumulating(96, 4, 4),
        "short_tail": train_accumulating(80, 4, 4, epochs=1),
        "fp16": fp16_group_skip(),
        "no_sync": manual_no_sync(),
    }


def single_process_reference(n: int, batch: int, epochs: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    loader = DataLoader(make_data(n), batch_size=batch, shuffle=True)
    for _ in range(epochs):
        for x, y in loader:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            sched.step()
            opt.zero_grad()
    return params(model)


__all__ = ["TensorDataset", "run_all", "single_process_reference"]
