"""A GAN: two models, two optimizers, two backward passes per step, all plain PyTorch.

    python examples/gan.py                          # one process
    accel-ctx launch -n 2 examples/gan.py           # two processes: both models under DDP

It trains for a number of optimizer steps, not epochs: on W processes each rank's loader holds
1/W of the data, so an epoch has W times fewer steps (each of W times more samples), as under
torchrun + DDP. A GAN's progress follows its steps: three epochs are 96 steps in one process and
48 on two, which leave the generated ring at radius 0.9 and 0.4 alike (the same 48 steps in one
process: 0.4 too). The same number of steps gives the same ring on any number of processes.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel_ctx import distributed, main_print, mixed_precision

NOISE = 16


def ring(n: int = 2048) -> TensorDataset:
    """Points on a noisy ring: what the generator learns to draw."""
    g = torch.Generator().manual_seed(0)
    angle = torch.rand(n, generator=g) * 2 * torch.pi
    points = torch.stack([angle.cos(), angle.sin()], 1) + 0.05 * torch.randn(n, 2, generator=g)
    return TensorDataset(points)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps to train")
    parser.add_argument("--precision", default="no", choices=["no", "bf16", "fp16"])
    args = parser.parse_args()

    torch.manual_seed(0)
    with distributed(), mixed_precision(args.precision):
        generator = nn.Sequential(nn.Linear(NOISE, 64), nn.ReLU(), nn.Linear(64, 2))
        critic = nn.Sequential(nn.Linear(2, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))
        g_opt = torch.optim.Adam(generator.parameters(), lr=1e-3, betas=(0.5, 0.999))
        d_opt = torch.optim.Adam(critic.parameters(), lr=1e-3, betas=(0.5, 0.999))
        loader = DataLoader(ring(), batch_size=64, shuffle=True)
        step = 0
        while step < args.steps:  # as many epochs as the steps take
            for (real,) in loader:
                fake = generator(torch.randn(real.shape[0], NOISE, device=real.device))
                # the critic: real points are 1, generated ones 0
                d_loss = (F.binary_cross_entropy_with_logits(critic(real), torch.ones_like(real[:, :1]))
                          + F.binary_cross_entropy_with_logits(critic(fake.detach()),
                                                               torch.zeros_like(real[:, :1])))
                d_loss.backward()
                d_opt.step()
                d_opt.zero_grad()
                # the generator: make the critic say 1
                g_loss = F.binary_cross_entropy_with_logits(critic(fake), torch.ones_like(real[:, :1]))
                g_loss.backward()
                g_opt.step()
                g_opt.zero_grad()
                d_opt.zero_grad()  # the critic's gradients from the generator's step
                step += 1
                if step % 100 == 0:
                    main_print(f"step {step}: critic {d_loss.item():.3f}  "
                               f"generator {g_loss.item():.3f}")
                if step >= args.steps:
                    break
        with torch.no_grad():
            radius = generator(torch.randn(512, NOISE)).norm(dim=1).mean().item()
        main_print(f"done: {step} steps; mean radius of generated points {radius:.2f} (the ring: 1)")


if __name__ == "__main__":
    main()
