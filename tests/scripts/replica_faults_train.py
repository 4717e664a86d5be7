"""A plain distributed() loop for faults a cluster makes to replica groups, bounded by the job's
committed steps, with dropout, an LR scheduler and a shuffled DataLoader. Arguments: output
folder, steps, groups, then the faults, each KIND:GROUP:STEP[:SECONDS], done by the group's first
worker in its first run after the step given:

- ``freeze:G:S:SEC``: stops itself (SIGSTOP) for SEC seconds (a child process sends SIGCONT), as
  a swapped-out or debugger-paused process;
- ``end:G:S``: its loop ends there, as a script with a step count of its own;
- ``kill:G:S``: SIGKILLs itself (its launcher restarts it, and it heals from a peer);
- ``freeze-in-state:G:N:SEC``: stops itself for SEC seconds inside its model's N-th
  ``state_dict()`` (the script calls none: a checkpoint's save, or the state a healing peer
  receives);
- ``save:K``: every group trains under ``resumable(OUT/ckpt, every_steps=K)`` (K: any group).

A group that is not alone steps quickly; alone it steps slowly, and past the bound it goes on
until every group still running has taken 3 steps together (or for at most 4 minutes). Each
step records the committed step, the groups in it and the samples it trained on; at the end the
weights, the worker's pid and restart count are saved, with the state() read at the scope's
entry."""

import os
import signal
import subprocess
import sys
import time
from contextlib import ExitStack

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from accel_ctx import distributed, resumable, state

out, steps, groups = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
faults = [f.split(":") for f in sys.argv[4:]]
deadline = time.monotonic() + 240  # a restart on a loaded machine takes long
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
torch.manual_seed(0)
data = TensorDataset(torch.arange(96), torch.randn(96, 8), torch.randn(96, 1))


def fault(kind: str, step: int) -> list[str] | None:
    s = state()
    for f in faults:
        if f[0] == kind and (int(f[1]), int(f[2]), s.rank, restart) == (s.replica_group, step, 0, 0):
            return f
    return None


def freeze(seconds: float) -> None:
    subprocess.Popen(["sh", "-c", f"sleep {seconds}; kill -CONT {os.getpid()}"],
                     start_new_session=True)
    os.kill(os.getpid(), signal.SIGSTOP)


saves = [int(f[1]) for f in faults if f[0] == "save"]
with distributed(), ExitStack() as scopes:
    if saves:
        scopes.enter_context(resumable(os.path.join(out, "ckpt"), every_steps=saves[0]))
    entry = {"step": state().step}
    ends = [int(f[2]) for f in faults if f[0] == "end" and int(f[1]) == state().replica_group]
    bound = ends[0] if ends else steps
    running = groups - sum(f[0] == "end" for f in faults)  # the groups that go to the end
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1),
                                torch.nn.Linear(16, 1))
    calls, me = [0], (state().replica_group, state().rank)

    def freeze_in_state(module: torch.nn.Module, *args: object) -> None:
        # called in torchft's thread for a healing peer: no scope there, so no state()
        calls[0] += 1
        for f in faults:
            if f[0] == "freeze-in-state" and (int(f[1]), 0, int(f[2]), 0) == (
                    *me, calls[0], restart):
                freeze(float(f[3]))

    model.register_state_dict_post_hook(freeze_in_state)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    loader = DataLoader(data, batch_size=4, shuffle=True)
    seen: list[dict] = []
    since: int | None = None
    done = False
    while not done:
        for idx, x, y in loader:
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            s = state()
            with torch.no_grad():  # equal weights, equal sums (the same additions)
                total = sum(p.double().sum() for p in model.parameters()).item()
            seen.append({"step": s.step, "groups": s.replica_groups, "samples": idx.tolist(),
                         "lr": sched.get_last_lr()[0], "sum": total})
            if (f := fault("freeze", s.step)) is not None:
                freeze(float(f[3]))
            if fault("kill", s.step) is not None:
                os.kill(os.getpid(), signal.SIGKILL)
            # the step since which every group still running trains together (the same in
            # each: a group that was away counts from the step it came back at)
            steady = len(seen) < 2 or seen[-2]["step"] == s.step - 1
            if s.replica_groups < running:
                since = None
            elif since is None or not steady:
                since = s.step
            time.sleep(0.05 if s.replica_groups > 1 else 0.3)
            done = s.step >= bound and (bool(ends) or time.monotonic() > deadline or (
                since is not None and s.step >= since + 2))
            if done:
                break
    torch.save({"seen": seen, "restart": restart, "pid": os.getpid(), "entry": entry,
                "step": state().step, "weights": model.state_dict()},
               os.path.join(out, f"group{state().replica_group}-rank{state().rank}.pt"))
