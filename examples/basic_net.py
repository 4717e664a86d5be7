"""PyTorch's MNIST example (BasicNet), with one added line: ``with distributed():``.

The data are random 28x28 images (no download): the point is the loop, which is the seed
tutorial's, unchanged.

    python examples/basic_net.py                   # one process
    accel-ctx launch -n 2 examples/basic_net.py    # two processes
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel_ctx import distributed, main_print


class BasicNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def fake_mnist(n: int = 512) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=None, help="stop after this many steps")
    args = parser.parse_args()

    torch.manual_seed(1)
    with distributed():  # the one added line
        model = BasicNet()
        optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        train_loader = DataLoader(fake_mnist(), batch_size=64, shuffle=True)
        step = 0
        for epoch in range(1, args.epochs + 1):
            if args.steps is not None and step >= args.steps:
                break
            model.train()
            for batch_idx, (data, target) in enumerate(train_loader):
                optimizer.zero_grad()
                output = model(data)
                loss = F.nll_loss(output, target)
                loss.backward()
                optimizer.step()
                step += 1
                if batch_idx % 4 == 0:
                    main_print(f"epoch {epoch} batch {batch_idx}: loss {loss.item():.4f}")
                if args.steps is not None and step >= args.steps:
                    break
            scheduler.step()
        main_print(f"done: {step} steps")


if __name__ == "__main__":
    main()
