"""Models, data and the plain training loop shared by the spawned workers and the tests."""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, TensorDataset


def make_data(n: int = 96, features: int = 8, classes: int = 3, seed: int = 1234) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, features, generator=g), torch.randint(0, classes, (n,), generator=g))


def make_images(n: int = 48, seed: int = 99) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g))


class MLP(nn.Module):
    def __init__(self, features: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, 32), nn.Tanh(), nn.Linear(32, classes))
        self.greeting = "hello"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def save_pretrained(self) -> dict[str, Any]:
        return {"greeting": self.greeting, "keys": sorted(self.state_dict())}


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(torch.relu(self.conv(x))).flatten(1))


def make_model(kind: str) -> nn.Module:
    return MLP() if kind == "mlp" else ConvNet()


def train(kind: str, batch_size: int, epochs: int = 2, lr: float = 0.1, seed: int = 0,
          num_workers: int = 0) -> nn.Module:
    """The user's plain loop: nothing in it knows about processes or devices."""
    torch.manual_seed(seed)
    model = make_model(kind)
    data = make_data() if kind == "mlp" else make_images()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loader = DataLoader(data, batch_size=batch_size, shuffle=True, num_workers=num_workers)
    for _ in range(epochs):
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return model


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


class LoggingDataset(Dataset[tuple[int, torch.Tensor]]):
    """Remembers which indices this process loaded."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.loaded: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        self.loaded.append(i)
        return i, torch.tensor([float(i)])


class ChunkBatchSampler(Sampler[list[int]]):
    """A custom batch sampler: uneven batches in a fixed odd order."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):  # type: ignore[no-untyped-def]
        order = list(range(self.n))[::-1]
        i, size = 0, 1
        while i < self.n:
            yield order[i : i + size]
            i += size
            size = size % 4 + 1

    def __len__(self) -> int:
        return sum(1 for _ in iter(self))


class Stream(IterableDataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(self.n))


R = TypeVar("R")


_own_groups = itertools.count()


def own_init_method(tag: str) -> str:
    """A rendezvous URL for a process group formed by hand, never used before in this run.

    A FileStore file lives until its last client closes it: a second group formed on the same path
    can read the first group's stale addresses ("Gloo connectFullMesh failed ... Connection
    refused") and leave the peer waiting. Every rank forms its own groups in the same order, so a
    per-process counter names the same fresh file on every rank.
    """
    return f"{os.environ['ACCEL_CTX_INIT_METHOD']}-{tag}-{next(_own_groups)}"


@contextlib.contextmanager
def hand_group(tag: str) -> Iterator[None]:
    """A process group formed by hand (its own FileStore, named by ``tag``) for the block's
    hand-written DDP or FSDP2 code; every rank meets at a barrier before it is destroyed."""
    dist.init_process_group("gloo", init_method=own_init_method(tag),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    try:
        yield
    finally:
        dist.barrier()
        dist.destroy_process_group()


class ListHandler(logging.Handler):
    """A logging handler that keeps the records it is given (a worker's logging calls, read)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def by_hand(fn: Callable[..., R], *args: Any) -> R:
    """Run hand-written DDP code ``fn`` in a process group formed by hand (its own FileStore).

    ``fn``'s DDP objects die when it returns and are collected before the group is destroyed:
    with torch 2.13 a DDP reducer freed after its gloo group was destroyed can deadlock.
    """
    dist.init_process_group("gloo", init_method=own_init_method("hand"),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    try:
        result = fn(*args)
        gc.collect()
        dist.barrier()
        return result
    finally:
        dist.destroy_process_group()
