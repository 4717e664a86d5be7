"""A plain distributed() loop, bounded by steps as a fault-tolerant loop is (a group that heals
continues from its peers' step). Arguments: output folder, steps, groups, then the group whose
first worker SIGKILLs itself after the step given last; it steps on until every group is back
(or for at most 4 minutes)."""

import os
import signal
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from accel_ctx import distributed, state

out, steps, groups = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
kill_group, kill_at = int(sys.argv[4]), int(sys.argv[5])
deadline = time.monotonic() + 240  # a restart on a loaded machine takes long
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
torch.manual_seed(0)
data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))

with distributed():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1),
                                torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = DataLoader(data, batch_size=4, shuffle=True)
    seen: list[tuple[int, int]] = []
    done = False
    while not done:
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            s = state()
            seen.append((s.step, s.replica_groups))
            if s.replica_group == kill_group and restart == 0 and s.step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            back = s.replica_groups == groups
            time.sleep(0.05 if back else 0.3)  # alone: step slowly until the group is back
            done = s.step >= steps and (back or time.monotonic() > deadline)
            if done:
                break
    torch.save({"seen": seen, "restart": restart, "weights": model.state_dict()},
               os.path.join(out, f"group{state().replica_group}.pt"))
