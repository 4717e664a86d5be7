"""local_sgd() on real ranks, against Local SGD and DiLoCo written by hand on DDP."""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.optim import PostLocalSGDOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from accel_ctx import accumulate, distributed, local_sgd, mixed_precision

from .common import MLP, by_hand, make_data, params

H, STEPS, BATCH = 3, 7, 4
OUTER = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
Batches = list[tuple[torch.Tensor, torch.Tensor]]


def scoped(diloco: bool, micro: int = 1, bf16: bool = False) -> dict[str, Any]:
    """The user's loop under local_sgd(); what it fed each step, to replay by hand."""
    seen: Batches = []
    snapshots: dict[int, dict[str, torch.Tensor]] = {}
    precision = mixed_precision("bf16") if bf16 else nullcontext()
    with distributed(), local_sgd(every=H, outer_optimizer=OUTER if diloco else None), \
            accumulate(micro), precision:
        torch.manual_seed(0)
        model = MLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        loader = DataLoader(make_data(2 * STEPS * BATCH), batch_size=BATCH // micro,
                            shuffle=True)
        for i, (x, y) in enumerate(loader):
            seen.append((x.clone(), y.clone()))
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if (i + 1) % micro == 0:
                snapshots[(i + 1) // micro] = params(model)
            if len(seen) == STEPS * micro:
                break
    return {"seen": seen, "steps": snapshots, "after_exit": params(model)}


def written_by_hand(seen: Batches, diloco: bool, micro: int = 1, bf16: bool = False,
                    torch_averager: bool = False) -> dict[str, Any]:
    """DDP with no_sync() on every backward, then every H steps the average (or DiLoCo's outer
    step: torchft's algorithm, the outer optimizer over the model's own parameters)."""
    torch.manual_seed(0)
    model = MLP()
    ddp = DDP(model)  # broadcasts rank 0's weights
    opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if torch_averager:  # torch's own Local SGD: averages after steps H, 2H, ...
        opt = PostLocalSGDOptimizer(opt, PeriodicModelAverager(period=H, warmup_steps=H - 1))
    world = dist.get_world_size()
    original = [p.detach().clone() for p in model.parameters()]
    outer = OUTER(list(model.parameters()))

    def sync() -> None:
        with torch.no_grad():
            if not diloco:
                for p in model.parameters():
                    dist.all_reduce(p.data)
                    p.data /= world
                return
            for p, g in zip(model.parameters(), original, strict=True):
                pseudo = g - p
                dist.all_reduce(pseudo)
                p.copy_(g)
                p.grad = pseudo / world
            outer.step()
            for p, g in zip(model.parameters(), original, strict=True):
                g.copy_(p)

    autocast: Callable[[], AbstractContextManager[Any]] = (
        (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else nullcontext)
    snapshots: dict[int, dict[str, torch.Tensor]] = {}
    for i, (x, y) in enumerate(seen):
        with ddp.no_sync():
            with autocast():  # the forward only, its output in float32, as mixed_precision()
                out = ddp(x).float()
            (F.cross_entropy(out, y) / micro).backward()
        if (i + 1) % micro:
            continue
        step = (i + 1) // micro
        opt.step()
        if step % H == 0 and not torch_averager:
            sync()
        opt.zero_grad()
        snapshots[step] = params(model)
    at_end = snapshots[STEPS]
    if STEPS % H and not torch_averager:
        sync()  # leaving the scope ends the period in progress
    return {"steps": snapshots, "at_end": at_end, "after_exit": params(model)}


def run_all() -> dict[str, Any]:
    plain = scoped(diloco=False)
    diloco = scoped(diloco=True)
    composed = scoped(diloco=True, micro=2, bf16=True)

    def references() -> dict[str, Any]:
        return {
            "plain": written_by_hand(plain["seen"], diloco=False),
            "torch": written_by_hand(plain["seen"], diloco=False, torch_averager=True),
            "diloco": written_by_hand(diloco["seen"], diloco=True),
            "composed": written_by_hand(composed["seen"], diloco=True, micro=2, bf16=True),
        }

    refs = by_hand(references)
    for run in (plain, diloco, composed):
        del run["seen"]
    return {"plain": plain, "diloco": diloco, "composed": composed, "refs": refs}
