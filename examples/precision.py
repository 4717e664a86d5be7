"""The model's own precision: ``"bf16-true"`` (the weights themselves in bf16) and ``"fp8"``
(torchao's float8 training for the Linear layers, bf16 autocast for the rest), beside ``"bf16"``.

The loop is the same for all three; only the scope's policy changes. ``"bf16-true"`` casts the
model in place at its first forward (half the bytes of weights, gradients and Adam's state, no
fp32 master weights); ``"fp8"`` swaps each Linear whose in and out features are multiples of 16
for torchao's ``Float8Linear`` (same parameters, same ``state_dict()`` keys; on a CPU float8 is
emulated: for checking a run, not for speed). fp8 needs torchao (``pip install torchao``);
without it that part is skipped, saying so.

    python examples/precision.py
    accel-ctx launch -n 2 examples/precision.py
    python examples/precision.py --policies bf16-true     # one of them
"""

from __future__ import annotations

import argparse
import importlib.util

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel_ctx import distributed, main_print, mixed_precision


def train(policy: str, data: TensorDataset, epochs: int) -> None:
    torch.manual_seed(0)  # the same model and order for every policy
    with distributed(), mixed_precision(policy):
        model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                              nn.Linear(64, 4))  # 4 outputs: no multiple of 16, stays bf16
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        loader = DataLoader(data, batch_size=32, shuffle=True)
        for _ in range(epochs):
            for x, y in loader:
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
        layers = sorted({type(m).__name__ for m in model.modules() if isinstance(m, nn.Linear)})
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
        main_print(f"{policy:>9}: loss {loss.item():.4f}, loss dtype "
                   f"{str(loss.dtype).removeprefix('torch.')}, parameters {'/'.join(dtypes)}, "
                   f"layers {'/'.join(layers)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--policies", nargs="+", default=["bf16", "bf16-true", "fp8"])
    args = parser.parse_args()

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 32, generator=g)
    y = (x[:, :8].sum(1) > 0).long() + 2 * (x[:, 8:16].sum(1) > 0).long()
    for policy in args.policies:
        if policy == "fp8" and importlib.util.find_spec("torchao") is None:
            main_print("      fp8: skipped: torchao is not installed (pip install torchao)")
            continue
        train(policy, TensorDataset(x, y), args.epochs)


if __name__ == "__main__":
    main()
