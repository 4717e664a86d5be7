"""The models and in-memory data the benchmarks train and evaluate."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

CLASSES = 10


class MLP(nn.Sequential):
    """A small MLP: 64 -> 256 -> 256 -> 10 (6 modules)."""

    features = 64

    def __init__(self) -> None:
        super().__init__(
            nn.Linear(self.features, 256), nn.ReLU(),
            nn.Linear(256, 256), nn.ReLU(),
            nn.Linear(256, CLASSES),
        )


class Block(nn.Module):
    """One tiny block: Linear + Tanh (3 modules with itself)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class DeepStack(nn.Module):
    """A deep stack of tiny blocks: ``3 * depth + 3`` modules, almost all call overhead."""

    def __init__(self, depth: int, width: int = 32) -> None:
        super().__init__()
        self.features = width
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def depth_for(modules: int) -> int:
    """The DeepStack depth giving about ``modules`` modules in all."""
    return max(1, round((modules - 3) / 3))


def make_model(name: str) -> nn.Module:
    """``"mlp"`` or ``"deepN"`` (a DeepStack of about N modules), seeded the same every time."""
    torch.manual_seed(0)
    if name == "mlp":
        return MLP()
    if name.startswith("deep"):
        return DeepStack(depth_for(int(name[4:])))
    raise ValueError(f"unknown model {name!r}: use 'mlp' or 'deepN' (N modules)")


def features_of(model: nn.Module) -> int:
    return int(model.features)  # type: ignore[arg-type]


def make_data(features: int, samples: int, seed: int = 1234) -> TensorDataset:
    """``samples`` random inputs with class labels, in memory."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(samples, features, generator=g),
        torch.randint(0, CLASSES, (samples,), generator=g),
    )
