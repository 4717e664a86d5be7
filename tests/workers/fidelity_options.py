"""Workers for tests/scopes/test_fidelity_options.py: options refused on real ranks (issue #23, 10-11)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from accel_ctx import distributed, sharded, skip_first_batches
from accel_ctx.errors import AccelCtxError

from .._timeouts import scaled


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.h = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.h:
            x = block(x)
        return self.head(x)


def _error_of(fn: Any) -> str | None:
    try:
        fn()
    except AccelCtxError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _sharded_now(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def misuse() -> dict[str, Any]:
    """On each of 2 ranks: blocks the model does not have, and skips past the epoch's end."""
    out: dict[str, Any] = {}
    x = torch.ones(2, 4)
    for name, blocks in (("missing_class", [nn.Conv2d]),
                         ("missing_fn", lambda m: isinstance(m, nn.Conv2d))):
        with distributed(timeout=scaled(60)), sharded(blocks=blocks):
            model = Net()
            out[name] = _error_of(lambda model=model: model(x))
            out[f"{name}_left_unsharded"] = not _sharded_now(model)
    with distributed(timeout=scaled(60)), sharded(blocks=[Block]):  # the job goes on, and works
        model = Net()
        model(x).sum().backward()
        out["named_blocks_shard"] = _sharded_now(model)

    loader = DataLoader(list(range(8)), batch_size=2)  # 4 batches: 2 per rank on 2 ranks
    skip_first_batches(loader, 3)  # outside a scope: within the 4 of one process
    with distributed(timeout=scaled(60)):
        out["skip_at_iteration"] = _error_of(lambda: list(loader))
        out["skip_at_call"] = _error_of(lambda: skip_first_batches(loader, 3))
        out["skip_all"] = [b.tolist() for b in skip_first_batches(loader, 2)]
        out["next_epoch"] = [b.tolist() for b in loader]
    return out
