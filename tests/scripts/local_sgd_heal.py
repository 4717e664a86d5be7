"""DiLoCo over replica groups across a kill: local_sgd(every=3, outer_optimizer=SGD with Nesterov
momentum) in a distributed() loop over a shuffled DataLoader; the first worker of the group
given SIGKILLs itself after the step given, restarts and heals from a live group. Arguments:
output folder, steps, kill group, kill step. Each step records the step, the groups in the last
synchronisation and the weights; each group steps on until it has synchronised with every group
three times in a row after the one the kill failed (or for at most 4 minutes), stopping at a
synchronisation (every group then stops at the same one)."""

import functools
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from accel_ctx import distributed, local_sgd, state

out, steps = sys.argv[1], int(sys.argv[2])
kill_group, kill_at = int(sys.argv[3]), int(sys.argv[4])
every = 3
failed = -(-kill_at // every) * every  # the sync the kill fails (it still counts 2 groups)
outer = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
deadline = time.monotonic() + 240  # a restart on a loaded machine takes long
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
torch.manual_seed(0)
data = TensorDataset(torch.randn(96, 8), torch.randn(96, 1))

with distributed(), local_sgd(every=every, outer_optimizer=outer):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(data, batch_size=4, shuffle=True)
    seen: list[dict] = []
    together = 0  # synchronisations with every group in a row
    done = False
    while not done:
        for x, y in loader:
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            s = state()
            seen.append({"step": s.step, "groups": s.replica_groups,
                         "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}})
            if (s.replica_group, s.rank, restart, s.step) == (kill_group, 0, 0, kill_at):
                os.kill(os.getpid(), signal.SIGKILL)
            if s.step % every:
                time.sleep(0.02)
                continue
            together = together + 1 if s.replica_groups == 2 and s.step > failed else 0
            time.sleep(0.05 if together else 0.3)  # alone: step slowly until the group is back
            done = s.step >= steps and (together >= 3 or time.monotonic() > deadline)
            if done:
                break
    torch.save({"seen": seen, "restart": restart},
               os.path.join(out, f"group{state().replica_group}-rank{state().rank}.pt"))
