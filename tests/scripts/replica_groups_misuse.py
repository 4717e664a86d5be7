"""A plain distributed() loop for replica groups started one by one, bounded by the job's
committed steps, with dropout and a shuffled DataLoader. Arguments: output folder, steps, and the
hidden layer's width (a group given another width trains another model). Each step records the
committed step and how many groups took it; at the end the weights are saved. An optional fourth
argument: the data set's length (64; a group given another reads another data set)."""

import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from accel_ctx import distributed, state

out, steps, width = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
samples = int(sys.argv[4]) if len(sys.argv) > 4 else 64
torch.manual_seed(0)
data = TensorDataset(torch.randn(samples, 8), torch.randn(samples, 1))

with distributed():
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Dropout(0.1),
                                torch.nn.Linear(width, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = DataLoader(data, batch_size=4, shuffle=True)
    seen: list[tuple[int, int]] = []
    while state().step < steps:
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            seen.append((state().step, state().replica_groups))
            time.sleep(0.1)
            if state().step >= steps:
                break
    torch.save({"seen": seen, "weights": model.state_dict()},
               os.path.join(out, f"group{state().replica_group}.pt"))
