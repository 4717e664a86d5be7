"""Distributed evaluation: each rank scores its share, ``gather_for_metrics`` collects every
sample exactly once (the padding that evens out the ranks is dropped).

    python examples/evaluate.py
    accel-ctx launch -n 3 examples/evaluate.py      # 1000 samples over 3 ranks: still 1000
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel_ctx import distributed, gather_for_metrics, main_print, state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=None, help="ignored (every batch is scored)")
    args = parser.parse_args()

    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, 8, generator=g)
    labels = (x.sum(1) > 0).long()  # a rule the "model" below knows exactly
    with distributed():
        model = nn.Linear(8, 2)
        with torch.no_grad():
            model.weight.copy_(torch.tensor([[-1.0] * 8, [1.0] * 8]))
            model.bias.zero_()
        predictions, targets = [], []
        with torch.no_grad():
            for xb, yb in DataLoader(TensorDataset(x, labels), batch_size=64):
                preds = model(xb).argmax(-1)
                p, t = gather_for_metrics((preds, yb))  # every rank's, in order, no duplicates
                predictions.append(p)
                targets.append(t)
        p, t = torch.cat(predictions), torch.cat(targets)
        main_print(f"{state().world_size} process(es) scored {len(p)} samples: "
                   f"accuracy {(p == t).float().mean().item():.3f}")


if __name__ == "__main__":
    main()
