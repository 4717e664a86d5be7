"""Local SGD, then DiLoCo, in one distributed() loop: local_sgd(every=3) over a shuffled
DataLoader, 8 steps each, on a fresh model and optimizer. Argument: the output folder. Each
process saves, per run, the weights it started from, what each step trained on and the weights
after it, and the weights after the scope's exit, for the test to replay by hand. (No dropout:
the replay could not draw the same masks.)"""

import functools
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from accel_ctx import distributed, local_sgd, state

out = sys.argv[1]
steps, every = 8, 3
outer = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
torch.manual_seed(0)
data = TensorDataset(torch.randn(96, 8), torch.randn(96, 1))


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


runs = {}
with distributed():
    for name, outer_optimizer in (("local_sgd", None), ("diloco", outer)):
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        loader = DataLoader(data, batch_size=4, shuffle=True)
        start = weights(model)
        seen = []
        with local_sgd(every=every, outer_optimizer=outer_optimizer):
            for x, y in loader:
                loss = F.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                s = state()
                seen.append({"x": x, "y": y, "loss": loss.item(), "step": s.step,
                             "groups": s.replica_groups, "weights": weights(model)})
                if len(seen) == steps:
                    break
        runs[name] = {"start": start, "seen": seen, "after_exit": weights(model)}
    torch.save(runs, os.path.join(out, f"group{state().replica_group}-rank{state().rank}.pt"))
