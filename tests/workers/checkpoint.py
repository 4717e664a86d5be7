"""Checkpoint workers: the plain loop under distributed(), fp16 and accumulate, stopped and resumed.

``run`` trains like a user script would: seed, build, ``load_state`` (a no-op without a
checkpoint), then epochs of the plain loop starting at the epoch ``load_state`` says. With
``stop`` it saves after that many micro-batches of this run and returns ("the job stopped").
"""

from __future__ import annotations

import os
import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from accel_ctx import accumulate, distributed, load_state, mixed_precision, save_state, state

from .._timeouts import scaled
from .common import make_data, params

EPOCHS = 3
BATCH = 4


class Net(nn.Module):
    """A small MLP with dropout, so the RNG states matter for the result."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(dropout), nn.Linear(32, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def optimizer_state(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for i, per_param in opt.state_dict()["state"].items():
        for name, value in per_param.items():
            if isinstance(value, torch.Tensor):
                out[f"{i}.{name}"] = value.detach().cpu().clone()
    return out


def run(ckpt: str, *, k: int, fp16: bool, dropout: float, stop: int | None = None,
        named: bool = True, eval_loader: bool = False, resume: bool = True,
        n: int = 96) -> dict[str, Any]:
    """The user's script. Returns the final (or stopped) state of this rank."""
    precision = mixed_precision("fp16" if fp16 else "no", init_scale=2.0**20, growth_interval=3)
    with distributed(timeout=scaled(60)), precision, accumulate(k):
        torch.manual_seed(0)
        random.seed(0)
        np.random.seed(0)
        model = Net(dropout)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.9)
        loader = DataLoader(make_data(n), batch_size=BATCH, shuffle=True)
        evaluation = DataLoader(make_data(24, seed=7), batch_size=BATCH, shuffle=True)
        objects: dict[str, Any] = {"model": model, "optimizer": opt, "scheduler": sched}
        if named:
            objects["loader"] = loader
        resumed = load_state(ckpt, **objects) if resume else None
        start = resumed.epoch if resumed else 0
        micro, seen, noise = 0, [], []
        for _epoch in range(start, EPOCHS):
            for x, y in loader:
                seen.append(x[:, 0].tolist())
                noise.append((random.random(), float(np.random.rand())))
                F.cross_entropy(model(x), y).backward()
                opt.step()
                sched.step()
                opt.zero_grad()
                micro += 1
                if stop is not None and micro == stop:
                    path = save_state(ckpt, **objects)
                    return {"path": str(path), "step": state().step, "seen": seen}
            if eval_loader:  # a second loader, unnamed: matched by the order of first iteration
                with torch.no_grad():
                    for x, _ in evaluation:
                        seen.append(x[:, 0].tolist())
        s = state()
        return {
            "params": params(model),
            "optimizer": optimizer_state(opt),
            "lr": opt.param_groups[0]["lr"],
            "step": s.step,
            "skipped": s.skipped_steps,
            "scale": s.loss_scale,
            "seen": seen,
            "noise": noise,
            "resumed": (resumed.step, resumed.epoch, resumed.world_size) if resumed else None,
        }


EXACT = {"k": 2, "fp16": True, "dropout": 0.2}
# 2 ranks x accumulate(3) x 4 samples per step; resumed as 1 x 6 and 3 x 2 (see the test).
RESHARD = {"fp16": False, "dropout": 0.0}
STOPS = {"mid_group": 5, "boundary": 8, "epoch_end": 12, "second_epoch": 19}


def stop_and_reference(root: str) -> dict[str, Any]:
    """On 2 ranks: the uninterrupted runs, and runs stopped (saved) at several points."""
    out: dict[str, Any] = {"full": run(f"{root}/none", **EXACT, resume=False)}
    out["full_unnamed"] = run(f"{root}/none", **EXACT, named=False, eval_loader=True,
                              resume=False)
    for name, stop in STOPS.items():
        out[name] = run(f"{root}/{name}", **EXACT, stop=stop)
    out["unnamed"] = run(f"{root}/unnamed", **EXACT, named=False, eval_loader=True, stop=19)
    out["reshard_full"] = run(f"{root}/none", k=3, **RESHARD, resume=False)
    out["reshard"] = run(f"{root}/reshard", k=3, **RESHARD, stop=6)
    out["uneven_rng_full"] = uneven_rng(f"{root}/none2")
    out["uneven_rng_stop"] = uneven_rng(f"{root}/uneven", stop=5)
    return out


def resume_same_world(root: str) -> dict[str, Any]:
    """On 2 ranks, in fresh processes: resume every stopped run."""
    torch.manual_seed(1234)  # whatever the process did before must not matter
    out = {name: run(f"{root}/{name}", **EXACT) for name in STOPS}
    out["unnamed"] = run(f"{root}/unnamed", **EXACT, named=False, eval_loader=True)
    out["uneven_rng"] = uneven_rng(f"{root}/uneven")
    return out


def resume_other_world(root: str) -> dict[str, Any]:
    """On 1 or 3 ranks: resume the 2-rank checkpoint with the same samples per optimizer step;
    on 1 rank also the one saved inside an accumulation group (it warns and goes on)."""
    world = int(os.environ["WORLD_SIZE"])
    out: dict[str, Any] = {"same_batch": run(f"{root}/reshard", k=6 // world, **RESHARD)}
    if world == 1:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out["mid_group"] = run(f"{root}/mid_group", **EXACT)
        out["warnings"] = [str(w.message) for w in caught]
    return out


def uneven_rng(ckpt: str, stop: int | None = None) -> list[float]:
    """Rank 1 alone draws from torch's RNG at every batch; a resumed run must draw the same."""
    with distributed(timeout=scaled(60)):
        torch.manual_seed(0)
        loader = DataLoader(make_data(), batch_size=BATCH, shuffle=True)
        resumed = load_state(ckpt, loader=loader) if stop is None else None
        draws = []
        for _epoch in range(resumed.epoch if resumed else 0, 2):
            for i, _ in enumerate(loader, 1):
                draws.append(torch.rand(()).item() if state().rank == 1 else 0.0)
                if i == stop:
                    save_state(ckpt, loader=loader)
                    return draws
        return draws


def train_script(ckpt: Path, out: Path, save_every: int, crash_after: int | None) -> None:
    """tests/scripts/checkpoint_train.py: save every ``save_every`` micro-batches; the first
    attempt's rank 1 SIGKILLs itself after ``crash_after`` micro-batches."""
    import signal

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    with distributed(timeout=scaled(60)), mixed_precision("fp16", init_scale=2.0**20, growth_interval=3), \
            accumulate(2):
        torch.manual_seed(0)
        model = Net(0.2)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.9)
        loader = DataLoader(make_data(), batch_size=BATCH, shuffle=True)
        resumed = load_state(ckpt, model=model, optimizer=opt, scheduler=sched)
        rank = state().rank
        (out / f"attempt{attempt}.rank{rank}").write_text(str(resumed.step))
        micro = 0
        for _epoch in range(resumed.epoch, EPOCHS):
            for x, y in loader:
                F.cross_entropy(model(x), y).backward()
                opt.step()
                sched.step()
                opt.zero_grad()
                micro += 1
                if micro % save_every == 0:
                    save_state(ckpt, model=model, optimizer=opt, scheduler=sched)
                if attempt == 0 and rank == 1 and crash_after is not None and micro == crash_after:
                    os.kill(os.getpid(), signal.SIGKILL)
        result = {"params": params(model), "optimizer": optimizer_state(opt),
                  "step": state().step, "resumed_step": resumed.step}
    torch.save(result, out / f"final.rank{rank}.pt")
