"""Run by `accel-ctx launch -n 2 --max-restarts K` in tests/resumable/test_resumable_shape.py: the common
shape of a training script, in resumable(), killed by itself at given steps.

usage: resumable_shape.py CKPT_DIR OUT_DIR ENGINE WORKERS
The seed is set before the scopes, `run.step` is read before the model is built (a log line)
and in the loop; the model has dropout, the loader shuffles without a generator of its own
(WORKERS worker processes). KILLS ("WHEN:SIGNAL[:RANK],..."; one per attempt) makes attempt i
send itself that signal (on every rank, or on RANK alone) at WHEN: a step number (when the loop
reads that step), `start` (before `distributed()`: the other rank is in the rendezvous) or
`restore` (inside the first forward of a resumed attempt: the model is restored, the optimizer,
scheduler and RNG streams are not yet). Every step appends "step loss.hex()
attempt" to OUT_DIR/loss.rank{R}; the finished run writes OUT_DIR/final.rank{R}.pt.
"""

from __future__ import annotations

import os
import signal
import sys
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel_ctx import distributed, resumable, sharded, state

ckpt, out, engine, workers = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
kills = [k.split(":") for k in os.environ.get("KILLS", "").split(",") if k]
when, signum, on_rank = (kills[attempt] + [""])[:3] if attempt < len(kills) else ("", "", "")
if on_rank and int(on_rank) != int(os.environ["RANK"]):
    when = ""
kill: tuple[int, signal.Signals] | None = (int(when), getattr(signal, signum)) \
    if when.isdigit() else None
if when == "start":
    os.kill(os.getpid(), getattr(signal, signum))
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))


def whole(value: torch.Tensor) -> torch.Tensor:
    full = getattr(value, "full_tensor", None)
    return (full() if full is not None else value).detach().clone()


torch.manual_seed(0)
with ExitStack() as scopes:
    scopes.enter_context(distributed())
    if engine == "sharded":
        scopes.enter_context(sharded())
    run = scopes.enter_context(resumable(ckpt, every_steps=3))
    print(f"rank {state().rank}: starting at step {run.step}", flush=True)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.2), nn.Linear(32, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(data, batch_size=4, shuffle=True, num_workers=workers)
    if when == "restore" and run.resumed:
        model.register_forward_pre_hook(lambda *_: os.kill(os.getpid(), getattr(signal, signum)))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, epochs=3,
                                                steps_per_epoch=len(loader))
    with (out / f"loss.rank{state().rank}").open("a") as log:
        for _epoch in run.epochs(3):
            for x, y in loader:
                if kill is not None and run.step == kill[0]:
                    os.kill(os.getpid(), kill[1])
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                sched.step()
                opt.zero_grad()
                log.write(f"{run.step} {loss.item().hex()} {attempt}\n")
                log.flush()

    final = {"params": {k: whole(v) for k, v in model.state_dict().items()},
             "optimizer": {f"{i}.{k}": whole(v) for i, s in opt.state_dict()["state"].items()
                           for k, v in s.items() if isinstance(v, torch.Tensor)},
             "scheduler": sched.state_dict(), "step": run.step}
    torch.save(final, out / f"final.rank{state().rank}.pt")
