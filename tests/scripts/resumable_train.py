"""Run by `accel-ctx launch -n 2 --max-restarts K` in tests/resumable/test_resumable.py: a plain loop in
resumable(), with no resume code, killed and restarted by the test.

usage: resumable_train.py CKPT_DIR OUT_DIR [EVERY_STEPS] [ENGINE]
ENGINE: "ddp" (default: distributed() alone) or "sharded" (distributed(), sharded(): FSDP2, each
rank saves its shards). Any number of processes. A small MLP with dropout, AdamW, OneCycleLR, a
shuffling DataLoader sharded by accel_ctx; every step appends "step loss.hex() attempt" to
OUT_DIR/loss.rank{R}. Each attempt writes its pid to OUT_DIR/pid.rank{R} (the test kills it)
and, once done, OUT_DIR/final.rank{R}.pt. The
environment variable STEP_SLEEP (seconds) slows each step so the test's kills land mid-run;
STOP_AT (a step) ends the attempt once that step's periodic save is staged (the scope's exit
waits for it to publish), as a run stopped there and continued by another command would.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from accel_ctx import distributed, load_state, resumable, sharded, state

EPOCHS = 3
ckpt, out = Path(sys.argv[1]), Path(sys.argv[2])
every = int(sys.argv[3]) if len(sys.argv) > 3 else 3
engine = sys.argv[4] if len(sys.argv) > 4 else "ddp"
pause = float(os.environ.get("STEP_SLEEP", "0"))
stop_at = int(os.environ.get("STOP_AT", "-1"))
attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
timeout = 60 * float(os.environ.get("ACCEL_CTX_TEST_TIMEOUT", "1"))

(out / f"pid.rank{os.environ['RANK']}").write_text(str(os.getpid()))  # the test kills it
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(96, 8, generator=g), torch.randint(0, 3, (96,), generator=g))


def whole(value: Any) -> Any:
    """A tensor as one process holds it (a sharded one gathered: every rank calls this)."""
    value = value.full_tensor() if isinstance(value, DTensor) else value
    return value.detach().clone()


with ExitStack() as scopes:
    scopes.enter_context(distributed(timeout=timeout))
    if engine == "sharded":
        scopes.enter_context(sharded())
    run = scopes.enter_context(resumable(ckpt, every_steps=every))
    rank, world = state().rank, state().world_size
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.2), nn.Linear(32, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(data, batch_size=4, shuffle=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2,
                                                total_steps=EPOCHS * len(data) // 4)  # any world
    taken = 0
    with (out / f"loss.rank{rank}").open("a") as log:
        for _epoch in run.epochs(EPOCHS):
            for x, y in loader:
                if run.step == stop_at:  # the batch fetched: the boundary's save is under way
                    sys.exit(0)
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                sched.step()
                opt.zero_grad()
                log.write(f"{run.step} {loss.item().hex()} {attempt}\n")
                log.flush()
                taken += 1
                if pause:
                    time.sleep(pause)
    if run.finished and all((out / f"final.rank{r}.pt").exists() for r in range(world)):
        sys.exit(0)  # started again once finished: no step ran, nothing was restored
    if not taken:  # killed after its last save, before this file: the loop met nothing
        load_state(ckpt, model0=model, optimizer0=opt)
    final = {"params": {k: whole(v) for k, v in model.state_dict().items()},
             "optimizer": {f"{i}.{k}": whole(v) for i, s in opt.state_dict()["state"].items()
                           for k, v in s.items() if isinstance(v, torch.Tensor)},
             "lr": opt.param_groups[0]["lr"], "step": run.step, "world": world}
    torch.save(final, out / f"final.rank{rank}.pt")
