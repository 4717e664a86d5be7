"""A plain distributed() loop, bounded by steps as a fault-tolerant loop is (a group that heals
continues from its peers' step), with an LR scheduler, dropout and a shuffled DataLoader.
Arguments: output folder, steps, groups, then the group whose first worker SIGKILLs itself after
the step given last (-1: none), and "sharded" to train under sharded() or "accumulate-bf16" under
accumulate(2) and mixed_precision("bf16"); it steps on until every group is back (or for at most 4
minutes). Each step records what must be equal in every group: the step, the groups in it, the
lr, a draw from torch's generator and the loader's position, and the samples it trained on; at
the end, the step state() read at the scope's entry. Mode "clip" clips the gradient norm to 0.05
(below every step's norm: each step is clipped) and records the norm clip_grad_norm_ returned;
"no_sync" takes each step over two batches, the first one's backward inside no_sync()."""

import os
import signal
import sys
import time
from contextlib import ExitStack

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from accel_ctx import (
    accumulate,
    distributed,
    loader_state,
    mixed_precision,
    no_sync,
    sharded,
    state,
)

out, steps, groups = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
kill_group, kill_at = int(sys.argv[4]), int(sys.argv[5])
mode = sys.argv[6] if len(sys.argv) > 6 else "distributed"


def scopes() -> ExitStack:
    stack = ExitStack()
    stack.enter_context(sharded() if mode == "sharded" else distributed())
    if mode == "accumulate-bf16":
        stack.enter_context(accumulate(2))
        stack.enter_context(mixed_precision("bf16"))
    return stack


deadline = time.monotonic() + 240  # a restart on a loaded machine takes long
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
torch.manual_seed(0)
data = TensorDataset(torch.arange(96), torch.randn(96, 8), torch.randn(96, 1))

with scopes():
    entry = state().step  # a restarted group reads 0 here: it heals at its first quorum
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1),
                                torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    loader = DataLoader(data, batch_size=4, shuffle=True)
    seen: list[dict] = []
    done, held = False, False
    while not done:
        for idx, x, y in loader:
            if mode == "no_sync" and not held:  # the step's first batch: not averaged yet
                with no_sync():
                    F.mse_loss(model(x), y).backward()
                held = True
                continue
            held = False
            loss = F.mse_loss(model(x), y)
            loss.backward()
            norm = (torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).item()
                    if mode == "clip" else None)
            opt.step()
            sched.step()
            opt.zero_grad()
            s = state()
            where = loader_state(loader)
            seen.append({"step": s.step, "groups": s.replica_groups, "lr": sched.get_last_lr()[0],
                         "draw": torch.rand(1).item(), "epoch": where["epoch"],
                         "consumed": where["consumed"], "samples": idx.tolist(), "norm": norm})
            if (s.replica_group, s.rank, restart, s.step) == (kill_group, 0, 0, kill_at):
                os.kill(os.getpid(), signal.SIGKILL)
            back = s.replica_groups == groups
            time.sleep(0.05 if back else 0.3)  # alone: step slowly until the group is back
            done = s.step >= steps and (back or time.monotonic() > deadline)
            if done:
                break
    weights = {k: v.full_tensor() if hasattr(v, "full_tensor") else v  # sharded(): gathered
               for k, v in model.state_dict().items()}
    torch.save({"seen": seen, "restart": restart, "weights": weights, "entry": entry},
               os.path.join(out, f"group{state().replica_group}-rank{state().rank}.pt"))
