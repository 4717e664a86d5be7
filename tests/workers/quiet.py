"""Correct training scripts under every scope print no warning (issue 41).

Each rank runs a few short loops as a user writes them, recording every warning shown (torch's,
gloo's, accel_ctx's) but the few that ``ALLOWED`` lists: torch's own, that the same script
written with torch alone prints too, each with why. Recorded, not raised: a warning raised as an
error inside torch could be caught there and change what runs.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel_ctx import (
    accumulate,
    distributed,
    load_state,
    local_sgd,
    mixed_precision,
    resumable,
    save_state,
    sharded,
)

# (message prefix, category): torch's own warnings in a correct script, that hand-written torch
# prints too. None under these scopes on torch 2.11.0 and 2.13.0 (CPU); docs/troubleshooting.md
# lists the ones outside them (tensor parallel under sharded(), inductor's first compile).
ALLOWED: tuple[tuple[str, type[Warning]], ...] = ()


@contextmanager
def caught() -> Iterator[list[warnings.WarningMessage]]:
    """Every warning shown inside, recorded (each time, not once per line) but for ALLOWED's."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for message, category in ALLOWED:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield seen


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _loop(scopes: list[AbstractContextManager[Any]], folder: str | None = None,
          workers: int = 0, clip: bool = False) -> float:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 4, (64,)))
    with ExitStack() as stack:
        for scope in scopes:
            stack.enter_context(scope)
        model = Net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
        loader = DataLoader(data, batch_size=8, shuffle=True, num_workers=workers)
        if folder is not None:
            load_state(folder, model=model, optimizer=opt, scheduler=sched)
        for step, (x, y) in enumerate(loader):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            if step == 3:
                break
        if folder is not None:
            save_state(folder, model=model, optimizer=opt, scheduler=sched)
        model.eval()
        with torch.no_grad():
            return float(model(data.tensors[0][:8]).sum())


def every_scope(folder: str) -> list[str]:
    """The loops that ran; any warning one of them shows fails the rank, naming it.
    (torch.compile is left to examples/compiled.py's smoke run, with every warning shown: its
    first compile here took 7 s of the 15.)"""
    ran = []
    loops: dict[str, Any] = {
        "distributed": lambda: _loop([distributed()], workers=1, clip=True),
        "bf16": lambda: _loop([distributed(), mixed_precision("bf16")], clip=True),
        "fp16": lambda: _loop([distributed(), mixed_precision("fp16")], clip=True),
        "accumulate": lambda: _loop([distributed(), accumulate(2)], clip=True),
        "local_sgd": lambda: _loop([distributed(), local_sgd(2)]),
        "sharded": lambda: _loop([sharded(), mixed_precision("bf16")], clip=True),
        "save_state": lambda: _loop([distributed()], folder=os.path.join(folder, "dcp")),
        "load_state": lambda: _loop([distributed()], folder=os.path.join(folder, "dcp")),
        "sharded_state": lambda: _loop([sharded()], folder=os.path.join(folder, "fsdp")),
        "resumable": lambda: _loop([distributed(), resumable(os.path.join(folder, "run"),
                                                                  every_steps=2)]),
    }
    for name, loop in loops.items():
        with caught() as seen:
            loop()
        shown = [f"{w.filename}:{w.lineno}: {w.category.__name__}: {w.message}" for w in seen]
        if shown:
            raise AssertionError(f"{name}: a correct script warned:\n" + "\n".join(shown))
        ran.append(name)
    return ran
