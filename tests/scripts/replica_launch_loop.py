"""A small training loop for the replica-group launcher's tests
(tests/launcher/test_replica_group_lifecycle.py). Arguments: output folder, steps, mode.

mode "distributed": the loop inside ``with distributed():``, bounded by the job's committed steps;
after each step it writes its step to progress<group>-<rank> (a test waits on it). mode "plain":
the same loop without any scope (the mistake the launcher must name under --replica-groups).
With steps 0 it trains until it is stopped (at most 5 minutes)."""

import os
import sys
import time

import torch
import torch.nn.functional as F

from accel_ctx import distributed, state

out, steps, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
deadline = time.monotonic() + 300
torch.manual_seed(0)
model = None


def train() -> None:
    global model
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    taken = 0
    while (taken < steps if steps else time.monotonic() < deadline):
        loss = F.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        taken += 1
        s = state()
        progress = os.path.join(out, f"progress{s.replica_group}-{s.rank}")
        # outside distributed() every group reads itself as group 0: two writers of one file,
        # each with a temporary of its own
        temporary = f"{progress}.{os.getpid()}.tmp"
        with open(temporary, "w") as f:
            f.write(str(s.step if mode == "distributed" else taken))
        os.replace(temporary, progress)
        time.sleep(0.1)


if mode == "distributed":
    with distributed():
        train()
else:
    train()
