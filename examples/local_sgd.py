"""Local SGD and DiLoCo: each rank trains its own copy for H steps, then the copies meet.

Inside ``local_sgd(every=H)`` a backward makes no all-reduce: ``opt.step()`` updates this
rank's weights only, and every H-th step ends with the ranks' parameters averaged (torch's
``PostLocalSGDOptimizer`` with a ``PeriodicModelAverager``). ``--outer`` makes it DiLoCo: the
averaged pseudo-gradient (the weights at the last meeting minus this rank's) is stepped by an
outer Nesterov SGD. The example records after which steps the ranks hold the same weights:
only the H-th ones (and the scope's exit, which averages as well).

    accel-ctx launch -n 2 examples/local_sgd.py
    accel-ctx launch -n 2 examples/local_sgd.py --every 8 --outer      # DiLoCo
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel_ctx import distributed, gather, local_sgd, main_print, state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--every", type=int, default=4, help="H: optimizer steps between meetings")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--outer", action="store_true", help="DiLoCo's outer Nesterov SGD")
    args = parser.parse_args()

    outer = (functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
             if args.outer else None)
    torch.manual_seed(0)
    x = torch.randn(512, 8)
    y = x[:, :2].sum(1, keepdim=True)
    with distributed(), local_sgd(every=args.every, outer_optimizer=outer):
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
        agreed = []
        for epoch in range(args.epochs):
            for xb, yb in loader:
                loss = F.mse_loss(model(xb), yb)
                loss.backward()   # no all-reduce
                opt.step()        # this rank's weights; every H-th step ends with the average
                opt.zero_grad()
                checksums = gather(torch.cat([p.detach().flatten() for p in model.parameters()])
                                   .double().sum().reshape(1))
                if bool((checksums == checksums[0]).all()):
                    agreed.append(state().step)
            main_print(f"epoch {epoch}: loss {loss.item():.4f}")
        kind = "DiLoCo" if args.outer else "local SGD"
        main_print(f"done: {kind} on {state().world_size} process(es), {state().step} steps, "
                   f"every {args.every}: the ranks' weights agreed after steps {agreed}")


if __name__ == "__main__":
    main()
