"""A plain distributed() loop, bounded by the job's committed steps, for replica groups started
one by one (`accel-ctx launch --lighthouse ... --replica-group I`). Arguments: output folder,
steps, groups. After each step it writes its step to progress<group> (a test waits on it); alone
it steps slowly and goes on past the bound until every group has taken 3 steps together (or for
at most 4 minutes), so a group started later joins a live job."""

import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from accel_ctx import distributed, state

out, steps, groups = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
deadline = time.monotonic() + 240  # a group's start on a loaded machine takes long
torch.manual_seed(0)
data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))

with distributed():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1),
                                torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = DataLoader(data, batch_size=4, shuffle=True)
    seen: list[tuple[int, int]] = []
    together = 0  # steps in a row that every group took part in
    while state().step < steps or not (together >= 3 or time.monotonic() > deadline):
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            s = state()
            seen.append((s.step, s.replica_groups))
            progress = os.path.join(out, f"progress{s.replica_group}")
            with open(progress + ".tmp", "w") as f:
                f.write(str(s.step))
            os.replace(progress + ".tmp", progress)
            together = together + 1 if s.replica_groups == groups else 0
            time.sleep(0.05 if together else 0.5)
            if s.step >= steps and (together >= 3 or time.monotonic() > deadline):
                break
    torch.save({"seen": seen, "weights": model.state_dict()},
               os.path.join(out, f"group{state().replica_group}.pt"))
