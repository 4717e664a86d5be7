"""resumable() on loops whose batches come from no DataLoader, in the forms users write: the
script of tests/resumable/test_resumable_forms.py (issue 52).

usage: resumable_forms.py FOLDER FORM STOP_AT
FORM: ``fixed`` (``@resumable(d)`` on a function whose loop is ``for x in xs:``), ``docs`` (the
docs' ``run = resumable(d)``, ``@run``, ``for epoch in run.epochs(2): for x in xs:``), ``with``
(the same loop in ``with resumable(d) as run:``), ``range`` (a DataLoader, its epochs counted
with ``range(3)`` after a ``state()`` read, as most scripts do), ``val`` (a validation loader
iterated once, before the first step, then never; the training loader's epochs in
``run.epochs(2)``), ``save_state`` (no resumable(): one step, then ``save_state(FOLDER, ...)``,
as a script of its own saves), ``late`` (``while run.step < 12:``, a second model and its optimizer
met at steps 1 and 11 only: after a restart the checkpoint resumed from is rotated out before
they are met again), ``ema``/``ema-tracked`` (an EMA made by ``copy.deepcopy(model)`` before
the loop, updated each step; ``run.track()``ed or not). The loop sends itself SIGTERM after its step
STOP_AT (0: never). Prints ``STEP n`` and ``WEIGHTS`` (the parameters' sums, in hex).
"""

import copy
import os
import signal
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel_ctx import distributed, resumable, save_state, state

folder, form, stop_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(0)
xs = torch.randn(8, 4, 4)  # 8 batches: the epoch
done = [0]


def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    done[0] += 1
    if done[0] == stop_at:
        os.kill(os.getpid(), signal.SIGTERM)


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


if form == "fixed":
    @resumable(folder, every_steps=3)
    def train_fixed() -> nn.Module:
        model, opt = build()
        for x in xs:
            step(model, opt, x)
        return model

    model = train_fixed()
    steps = done[0]
elif form == "docs":
    run = resumable(folder, every_steps=3)

    @run
    def train() -> nn.Module:
        model, opt = build()
        for _epoch in run.epochs(2):
            for x in xs:
                step(model, opt, x)
        return model

    model = train()
    steps = run.step
elif form == "save_state":
    with distributed():
        model, opt = build()
        step(model, opt, xs[0])
        save_state(folder, model=model, optimizer=opt)
    steps = 1
elif form == "late":
    with resumable(folder, every_steps=2, keep_last=2) as run:
        model, opt = build()
        critic = nn.Linear(4, 1)  # unlike the model: each finds its own state
        critic_opt = torch.optim.SGD(critic.parameters(), lr=0.1, momentum=0.9)
        while run.step < 12:
            x = xs[run.step % 8]
            if run.step in (0, 10):
                critic(x).pow(2).mean().backward()
                critic_opt.step()
                critic_opt.zero_grad()
            step(model, opt, x)
    steps = run.step
    model = nn.Sequential(model, critic)
elif form.startswith("ema"):
    with resumable(folder, every_steps=2) as run:
        model, opt = build()
        ema = copy.deepcopy(model)
        if form == "ema-tracked":
            run.track(ema=ema)
        while run.step < 6:
            step(model, opt, xs[run.step])
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.parameters(), strict=True):
                    e.mul_(0.9).add_(p, alpha=0.1)
    steps = run.step
    model = ema
elif form == "range":
    with resumable(folder, every_steps=2) as run:
        print(f"rank {state().rank} of {state().world_size}")
        model, opt = build()
        loader = DataLoader(TensorDataset(xs.reshape(32, 4)), batch_size=4, shuffle=True)
        for _epoch in range(3):
            for (x,) in loader:
                step(model, opt, x)
    steps = run.step
elif form.startswith("val"):
    with resumable(folder, every_steps=3) as run:
        model, opt = build()
        g = torch.Generator().manual_seed(1)
        train_data = TensorDataset(torch.randn(40, 4, generator=g))
        val_data = TensorDataset(torch.randn(40 if form == "val-same" else 16, 4, generator=g))
        loader = DataLoader(train_data, batch_size=4, shuffle=True)
        val_loader = DataLoader(val_data, batch_size=4, shuffle=form == "val-same")
        for epoch in run.epochs(2):
            if epoch == 0 and run.step == 0:
                with torch.no_grad():
                    print("VAL", sum(model(x).sum().item() for (x,) in val_loader))
            for (x,) in loader:
                step(model, opt, x)
    steps = run.step
else:
    with resumable(folder, every_steps=3) as run:
        model, opt = build()
        for _epoch in run.epochs(2):
            for x in xs:
                step(model, opt, x)
    steps = run.step
print("STEP", steps)
print("WEIGHTS", " ".join(p.detach().sum().item().hex() for p in model.parameters()))
