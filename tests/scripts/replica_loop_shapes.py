"""Loop shapes a replica group's gradient average must meet as DDP does, written as real
scripts write them, seed before the scopes, a loader without a generator. Arguments: output
folder, then the shape:

- "gan": two models, two optimizers, the discriminator's loss backward through a detached
  generator output, then the generator's through the discriminator (whose gradients it makes
  too, zeroed before its next step), each clipped;
- "checkpoint": a frozen first layer and activation checkpointing (reentrant, as HF's
  ``gradient_checkpointing_enable`` sets it) in the forward;
- "two_losses": two forwards and backwards accumulated by hand before one step;
- "autograd_backward": ``torch.autograd.backward(loss)`` instead of ``loss.backward()``.

Rank 0 of each group (or of the DDP job) saves every step's norms and the final weights."""

import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from accel_ctx import distributed, state

out, shape = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))


class Checkpointed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)
        self.embed.requires_grad_(False)
        self.block = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = checkpoint(self.block, h.requires_grad_(), use_reentrant=True)
        return self.head(h)


with distributed():
    norms: list[list[float]] = []
    loader = DataLoader(data, batch_size=4, shuffle=True)
    if shape == "gan":
        gen, disc = torch.nn.Linear(8, 8), torch.nn.Sequential(torch.nn.Linear(8, 1))
        opt_g = torch.optim.Adam(gen.parameters(), lr=0.01)
        opt_d = torch.optim.Adam(disc.parameters(), lr=0.01)
        for x, _ in loader:
            fake = gen(torch.randn_like(x))
            d_loss = F.softplus(disc(fake.detach())).mean() + F.softplus(-disc(x)).mean()
            opt_d.zero_grad()
            d_loss.backward()
            n_d = torch.nn.utils.clip_grad_norm_(disc.parameters(), 0.05).item()
            opt_d.step()
            g_loss = F.softplus(-disc(fake)).mean()
            opt_g.zero_grad()
            g_loss.backward()
            n_g = torch.nn.utils.clip_grad_norm_(gen.parameters(), 0.05).item()
            opt_g.step()
            norms.append([n_d, n_g])
        models = {"gen": gen, "disc": disc}
    else:
        model = Checkpointed() if shape == "checkpoint" else torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
        batches = iter(loader)
        for x, y in batches:
            loss = F.mse_loss(model(x), y)
            if shape == "autograd_backward":
                torch.autograd.backward(loss)
            else:
                loss.backward()
            if shape == "two_losses":
                x2, y2 = next(batches)
                F.mse_loss(model(x2), y2).backward()
            norms.append([torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).item()])
            opt.step()
            opt.zero_grad()
        models = {"model": model}
    s = state()
    if s.rank == 0:
        torch.save({"norms": norms, "step": s.step,
                    "weights": {f"{name}.{k}": v for name, m in models.items()
                                for k, v in m.state_dict().items()}},
                   os.path.join(out, f"group{max(s.replica_group, 0)}.pt"))
