"""sharded(tp=2) over replica groups across a kill: each group of 2 ranks splits a small MLP over
"tp" ("colwise" up, "rowwise" down); the first worker of the group given SIGKILLs itself after
the step given, restarts and heals its shards from the same rank of a live group. Arguments:
output folder, steps, kill group, kill step. Each step records the step, the groups in it and
this rank's shards; each group steps on until it has taken 4 steps in a row with every group
after the kill (or for at most 4 minutes)."""

import os
import signal
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from accel_ctx import sharded, state

out, steps = sys.argv[1], int(sys.argv[2])
kill_group, kill_at = int(sys.argv[3]), int(sys.argv[4])
deadline = time.monotonic() + 240  # a restart on a loaded machine takes long
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
torch.manual_seed(0)
data = TensorDataset(torch.randn(96, 8), torch.randn(96, 1))

with sharded(tp=2, tp_plan={"0": "colwise", "2": "rowwise"}):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(data, batch_size=4, shuffle=True)
    seen: list[dict] = []
    together = 0  # steps in a row with every group, after the kill
    done = False
    while not done:
        for x, y in loader:
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            s = state()
            seen.append({"step": s.step, "groups": s.replica_groups, "shards": {
                k: v.to_local().clone() for k, v in model.state_dict().items()}})
            if (s.replica_group, s.rank, restart, s.step) == (kill_group, 0, 0, kill_at):
                os.kill(os.getpid(), signal.SIGKILL)
            together = together + 1 if s.replica_groups == 2 and s.step > kill_at else 0
            time.sleep(0.05 if together else 0.3)  # alone: step slowly until the group is back
            done = s.step >= steps and (together >= 4 or time.monotonic() > deadline)
            if done:
                break
    torch.save({"seen": seen, "restart": restart},
               os.path.join(out, f"group{state().replica_group}-rank{state().rank}.pt"))
