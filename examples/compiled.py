"""``torch.compile`` inside the scopes: compile the model as you would without accel_ctx.

The scopes' work for a call of the model (moving the batch, DDP, autocast, accumulation) runs
once per call, outside the compiled code; inside it the model's forward is one graph, the one
it makes outside any scope: no graph break and no recompile come from accel_ctx. The example
counts the graphs Dynamo hands to the backend: one for the training forward.

    python examples/compiled.py                           # inductor (needs a C compiler on CPU)
    python examples/compiled.py --backend aot_eager       # quicker to compile, for a check
    accel-ctx launch -n 2 examples/compiled.py
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel_ctx import accumulate, distributed, main_print, mixed_precision


class Net(nn.Module):
    # A class of your own, as in real scripts: Dynamo does not trace a bare ``nn.Sequential``
    # compiled in place (its frames are all torch's own), with or without accel_ctx.
    def __init__(self) -> None:
        super().__init__()
        self.up, self.drop, self.down = nn.Linear(16, 64), nn.Dropout(0.1), nn.Linear(64, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.drop(F.gelu(self.up(x))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--precision", default="bf16")
    args = parser.parse_args()

    torch.manual_seed(0)
    x = torch.randn(256, 16)
    y = (x[:, :4].sum(1) > 0).long()
    with distributed(), mixed_precision(args.precision), accumulate(2):
        model = Net()
        backend = torch._dynamo.lookup_backend(args.backend)
        graphs = []

        def counting(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> object:
            graphs.append(gm)  # one per graph: a graph break or a recompile would add one
            return backend(gm, inputs)

        model.compile(backend=counting)       # in place: `model` keeps its class and its keys
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
        for epoch in range(args.epochs):
            for xb, yb in loader:
                loss = F.cross_entropy(model(xb), yb)  # compiled, under autocast
                loss.backward()
                opt.step()                             # every 2nd micro-batch
                opt.zero_grad()
            main_print(f"epoch {epoch}: loss {loss.item():.4f}")
        # inside the scope: main_print knows the rank there (outside, every process is rank 0)
        main_print(f"done: {type(model).__name__} {list(model.state_dict())[:2]}, "
                   f"{len(graphs)} graph(s) compiled")


if __name__ == "__main__":
    main()
