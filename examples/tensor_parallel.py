"""Tensor parallelism: each block's MLP split over 2 ranks, the loop unchanged.

``sharded(tp=2)`` splits the planned layers of every block over the ranks of a tensor-parallel
group (``"colwise"``: the up projection's output features, ``"rowwise"``: the down projection's
input features, the outputs summed) and shards the rest with FSDP2 across the groups. With 2
processes there is one group of 2: both ranks get the same batches; with 4, two groups split
the data.

    accel-ctx launch -n 2 examples/tensor_parallel.py
    accel-ctx launch -n 4 examples/tensor_parallel.py      # 2 data-parallel x 2 tensor-parallel
    python examples/tensor_parallel.py                     # one process: refused, naming why
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel_ctx import gather_for_metrics, main_print, sharded, state

WIDTH, CLASSES = 32, 4


class Block(nn.Module):
    """A transformer block's MLP half: norm, up, GELU, down, residual."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, depth: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


PLAN = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}  # `*`: one path segment


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()

    torch.manual_seed(0)
    x = torch.randn(512, 8)
    y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:].sum(1) > 0).long()
    data = TensorDataset(x, y)
    with sharded(tp=args.tp, tp_plan=PLAN):
        model = Net()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)  # made before: follows the split
        loader = DataLoader(data, batch_size=32, shuffle=True)
        for epoch in range(args.epochs):
            for xb, yb in loader:             # the ranks of a TP group get the same batch
                loss = F.cross_entropy(model(xb), yb)
                loss.backward()
                opt.step()
                opt.zero_grad()
            main_print(f"epoch {epoch}: loss {loss.item():.4f}")

        up = model.blocks[0].up.weight        # a DTensor: this rank holds its rows
        s = state()
        print(f"rank {s.rank}: tp_rank {s.tp_rank}/{s.tp_size}, dp_rank {s.dp_rank}/{s.dp_size}, "
              f"blocks.0.up.weight {tuple(up.shape)} holds {tuple(up.to_local().shape)} here",
              flush=True)

        correct = seen = 0
        with torch.no_grad():
            for xb, yb in DataLoader(data, batch_size=64):
                preds, labels = gather_for_metrics((model(xb).argmax(-1), yb))  # each sample once
                correct += int((preds == labels).sum())
                seen += len(labels)
        main_print(f"{s.world_size} processes (tp={s.tp_size}, dp={s.dp_size}) scored "
                   f"{seen} samples: accuracy {correct / seen:.3f}")


if __name__ == "__main__":
    main()
