"""fp16 clipping versus torch's GradScaler recipe, with an overflow injected (issue 11, point 3).

The recipe: ``scaler.scale(loss).backward(); scaler.unscale_(opt); clip(...); scaler.step(opt);
scaler.update()``. The scoped loop is the plain loop with the same clip call. An inf is
injected before the first optimizer step or mid-run; the step it poisons must be skipped on
both sides, and the weights must stay bit-identical.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

import accel_ctx
from accel_ctx import distributed, mixed_precision, state

from .common import MLP, by_hand, make_data, params

Clip = Callable[[Iterable[torch.Tensor]], Any]


def clip_fns(routed: bool) -> dict[str, Clip]:
    """The clip calls of a loop: torch's names (routed inside a scope) or accel_ctx's own."""
    if routed:  # looked up at each call, as a loop writing torch.nn.utils.clip_... does
        return {
            "value": lambda p: torch.nn.utils.clip_grad_value_(p, 0.01),
            "norm": lambda p: torch.nn.utils.clip_grad_norm_(p, 0.05),
        }
    return {
        "value": lambda p: accel_ctx.clip_grad_value_(p, 0.01),
        "norm": lambda p: accel_ctx.clip_grad_norm_(p, 0.05),
    }


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _poison(model: torch.nn.Module, loss: torch.Tensor, step: int, at: int, where: str) -> torch.Tensor:
    """Make step ``at`` overflow: an inf in the loss on the last rank, or in one gradient."""
    if step == at and where == "loss" and _rank() == int(os.environ.get("WORLD_SIZE", "1")) - 1:
        return loss * float("inf")
    return loss


def _poison_grad(model: torch.nn.Module, step: int, at: int, where: str) -> None:
    if step == at and where == "grad":
        weight = model.net[0].weight
        assert weight.grad is not None
        weight.grad[0, 0] = float("inf")


def recipe(clip: Clip, at: int, where: str, batches: list[Any], ddp: bool) -> dict[str, Any]:
    """torch's own AMP recipe, by hand: unscale_, then clip, then step (skipped on inf)."""
    torch.manual_seed(0)
    model = MLP()
    net: torch.nn.Module = DistributedDataParallel(model) if ddp else model
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    for i, (x, y) in enumerate(batches):
        with torch.autocast("cpu", dtype=torch.float16):
            out = net(x)
        loss = _poison(model, F.cross_entropy(out.float(), y), i, at, where)
        scaler.scale(loss).backward()
        _poison_grad(model, i, at, where)
        scaler.unscale_(opt)
        clip(model.parameters())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return {"params": params(model), "scale": scaler.get_scale()}


def scoped(clip: Clip, at: int, where: str, dist: bool) -> dict[str, Any]:
    """The plain loop (clip before the first step), inside the scopes."""
    scopes = [distributed()] if dist else []
    with mixed_precision("fp16"):
        for scope in scopes:
            scope.__enter__()
        try:
            torch.manual_seed(0)
            model = MLP()
            opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
            batches = []
            for i, (x, y) in enumerate(DataLoader(make_data(), batch_size=8, shuffle=True)):
                batches.append((x, y))
                loss = _poison(model, F.cross_entropy(model(x), y), i, at, where)
                loss.backward()
                _poison_grad(model, i, at, where)
                clip(model.parameters())
                opt.step()
                opt.zero_grad()
            info = state()
            return {"params": params(model), "scale": info.loss_scale,
                    "skipped": info.skipped_steps, "batches": batches}
        finally:
            for scope in reversed(scopes):
                scope.__exit__(None, None, None)


def compare(routed: bool, name: str, at: int, where: str, dist: bool) -> dict[str, Any]:
    clip = clip_fns(routed)[name]
    mine = scoped(clip, at, where, dist)
    batches = mine.pop("batches")
    if dist:
        hand = by_hand(recipe, clip, at, where, batches, True)
    else:
        hand = recipe(clip, at, where, batches, False)
    same = all(torch.equal(mine["params"][k], hand["params"][k]) for k in hand["params"])
    finite = all(bool(torch.isfinite(v).all()) for v in mine["params"].values())
    return {"same": same, "finite": finite, "scale": mine["scale"], "hand_scale": hand["scale"],
            "skipped": mine["skipped"]}


CASES = [
    (routed, name, at)
    for routed in (True, False)
    for name in ("value", "norm")
    for at in (0, 3)
]


def two_ranks() -> dict[str, dict[str, Any]]:
    """Every case on this rank: the overflow comes from the last rank's loss."""
    return {f"{r}-{n}-{a}": compare(r, n, a, "loss", True) for r, n, a in CASES}
