"""The main demo: a plain training loop, unchanged, on 1 or N processes.

    python examples/train.py                      # one process
    accel-ctx launch -n 2 examples/train.py       # two processes on this machine
    accel-ctx launch -n 2 --mixed-precision bf16 examples/train.py   # the same, in bf16

``--precision`` is left unset so that the launcher's ``--mixed-precision`` applies; given, it
wins over the launcher's setting (which is then reported once, as a warning).

The loop below has no device handling, no DistributedSampler and no DDP wrapper: the scopes
route its plain calls to PyTorch's engines.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel_ctx import distributed, mixed_precision, on_main_process, reduce, state


def make_dataset(n: int = 2048, seed: int = 0) -> TensorDataset:
    """Two noisy interleaved spirals: small, made on the spot, not linearly separable."""
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(n, generator=g) * 4 * torch.pi
    label = torch.randint(0, 2, (n,), generator=g)
    radius = t / (4 * torch.pi)
    angle = t + label * torch.pi
    x = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1)
    return TensorDataset(x + 0.02 * torch.randn(n, 2, generator=g), label)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _setup() -> str:
    s = state()
    precision = "fp32" if s.mixed_precision == "no" else s.mixed_precision
    return (f"{s.world_size} process{'es' if s.world_size > 1 else ''} on "
            f"{s.device.type}, {precision}")


@on_main_process
def announce(epochs: int, batches: int) -> None:
    print(f"training: {_setup()}; {epochs} epochs of {batches} batches per process")


@on_main_process
def report(epoch: int, loss: float, accuracy: float) -> None:
    print(f"epoch {epoch}: loss {loss:.4f}  accuracy {accuracy:.3f}  ({_setup()})")


@on_main_process
def summary(accuracy: float, seconds: float) -> None:
    verdict = "OK" if accuracy >= 0.9 else "lower than expected (try more --epochs)"
    print(f"done in {seconds:.1f} s: final accuracy {accuracy:.3f} on the spirals: {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--precision", default=None, choices=["no", "bf16", "fp16"],
                        help="default: the launcher's --mixed-precision, else no")
    args = parser.parse_args()

    torch.manual_seed(0)
    start = time.monotonic()
    with distributed(), mixed_precision(args.precision):
        model = Net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = DataLoader(make_dataset(), batch_size=64, shuffle=True)
        announce(args.epochs, len(loader))
        accuracy = 0.0
        for epoch in range(args.epochs):
            sums = torch.zeros(3)  # loss, correct, samples of this rank
            for x, y in loader:
                out = model(x)
                loss = F.cross_entropy(out, y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                sums += torch.tensor([loss.item() * len(y), (out.argmax(-1) == y).sum().item(), len(y)])
            total, correct, seen = reduce(sums).tolist()  # summed over all ranks
            accuracy = correct / seen
            report(epoch, total / seen, accuracy)
        summary(accuracy, time.monotonic() - start)


if __name__ == "__main__":
    main()
