"""resumable() in replica groups: a plain loop that every group's first worker SIGKILLs at the
step given (-1: none), so the whole job is lost and restarts from the folder. Arguments: output
folder, steps, kill step, "shared" (one folder for the job) or "per-group" (a folder named
after the group: refused), and optionally the one group to kill (default: every group)."""

import os
import signal
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from accel_ctx import distributed, resumable, state

out, steps, kill_at, place = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
only = int(sys.argv[5]) if len(sys.argv) > 5 else None
# alone, a group steps on until the other is back (a refused one does not come back)
deadline = time.monotonic() + (240 if place == "shared" else 0)
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
if restart and os.environ.get("REPLICA_GROUP_ID") == "1":
    time.sleep(3)  # back later than group 0: the restarted job still steps with both groups
torch.manual_seed(0)
data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))

with distributed():
    group = state().replica_group
    folder = os.path.join(out, "ckpt" if place == "shared" else f"ckpt-group{group}")
    with resumable(folder, every_steps=3) as run:
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1),
                                    torch.nn.Linear(16, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        loader = DataLoader(data, batch_size=4, shuffle=True)

        def more() -> bool:
            together = state().replica_groups == 2 or time.monotonic() > deadline
            return state().step < steps or not together

        while more():
            for x, y in loader:
                loss = F.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                if restart == 0 and state().step == kill_at and only in (None, group):
                    # the save of step 3 runs beside the steps: killed once it is whole
                    while not any(n.startswith("ckpt-") for n in os.listdir(folder)):
                        time.sleep(0.05)
                    os.kill(os.getpid(), signal.SIGKILL)
                if state().replica_groups < 2:
                    time.sleep(0.2)
                if not more():
                    break
    torch.save({"restart": restart, "step": state().step, "weights": model.state_dict()},
               os.path.join(out, f"group{group}.pt"))
