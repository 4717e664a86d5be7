"""minGPT's trainer (karpathy/minGPT, ``mingpt/trainer.py``), as written there, on a tiny model.

Its loader samples with replacement from a sampler of ``int(1e10)`` indices and runs
``max_iters`` steps of ``next(data_iter)``; migrated, the script gains one ``with distributed():``
line around it. The dataset notes every index it loads (``num_workers=0``), so a test sees which
samples each rank trained on; :func:`lists_drawn_at_most` fails the run as soon as more of the
sampler's order is drawn than the steps taken need (an order taken whole never comes back).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, RandomSampler


class Trainer:
    """mingpt/trainer.py's Trainer.run, line for line (the config is a namespace here)."""

    @staticmethod
    def get_default_config() -> SimpleNamespace:
        return SimpleNamespace(device="auto", num_workers=4, max_iters=None, batch_size=64,
                               learning_rate=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                               grad_norm_clip=1.0)

    def __init__(self, config: Any, model: nn.Module, train_dataset: Any) -> None:
        self.config = config
        self.model = model
        self.optimizer: Any = None
        self.train_dataset = train_dataset
        self.callbacks: dict[str, list[Any]] = defaultdict(list)
        if config.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        else:
            self.device = config.device
        self.model = self.model.to(self.device)
        self.iter_num = 0
        self.iter_time = 0.0
        self.iter_dt = 0.0

    def add_callback(self, onevent: str, callback: Any) -> None:
        self.callbacks[onevent].append(callback)

    def trigger_callbacks(self, onevent: str) -> None:
        for callback in self.callbacks.get(onevent, []):
            callback(self)

    def run(self) -> None:
        model, config = self.model, self.config
        self.optimizer = model.configure_optimizers(config)  # type: ignore[operator]
        train_loader = DataLoader(
            self.train_dataset,
            sampler=torch.utils.data.RandomSampler(self.train_dataset, replacement=True,
                                                   num_samples=int(1e10)),
            shuffle=False,
            pin_memory=True,
            batch_size=config.batch_size,
            num_workers=config.num_workers,
        )
        model.train()
        self.iter_num = 0
        self.iter_time = time.time()
        data_iter = iter(train_loader)
        while True:
            try:
                batch = next(data_iter)
            except StopIteration:
                data_iter = iter(train_loader)
                batch = next(data_iter)
            batch = [t.to(self.device) for t in batch]
            x, y = batch
            logits, self.loss = model(x, y)  # noqa: RUF059 - as minGPT writes it
            model.zero_grad(set_to_none=True)
            self.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_norm_clip)
            self.optimizer.step()
            self.trigger_callbacks("on_batch_end")
            self.iter_num += 1
            tnow = time.time()
            self.iter_dt = tnow - self.iter_time
            self.iter_time = tnow
            if config.max_iters is not None and self.iter_num >= config.max_iters:
                break


class TinyGPT(nn.Module):
    """The shape of minGPT's GPT: forward(idx, targets) -> (logits, loss), its own optimizer."""

    def __init__(self, vocab: int = 3, width: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.drop = nn.Dropout(0.1)
        self.lm_head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        logits = self.lm_head(self.drop(self.wte(idx)))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                   ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, config: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=config.learning_rate, betas=config.betas)


class SortDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """minGPT's sorting demo's data (made from the index), noting each index it loads."""

    def __init__(self, n: int = 50, length: int = 6) -> None:
        self.n, self.length = n, length
        self.loaded: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.loaded.append(idx)
        g = torch.Generator().manual_seed(idx)
        inp = torch.randint(3, size=(self.length,), generator=g)
        sol = torch.sort(inp)[0]
        cat = torch.cat((inp, sol), dim=0)
        x, y = cat[:-1].clone(), cat[1:].clone()
        y[: self.length - 1] = -1
        return x, y


@contextlib.contextmanager
def lists_drawn_at_most(lists: int) -> Iterator[None]:
    """Fail the block once RandomSampler draws more than ``lists`` lists of indices (with
    replacement, 32 indices a ``torch.randint``; else a ``torch.randperm``): the order is to be
    taken as it is needed."""
    code = RandomSampler.__iter__.__code__
    draws = (torch.randint, torch.randperm)
    drawn = 0

    def count(frame: Any, event: str, arg: Any) -> None:
        nonlocal drawn
        if event == "c_call" and arg in draws and frame.f_code is code:
            drawn += 1
            if drawn > lists:
                raise AssertionError(f"the sampler's order was drawn past {lists} lists")

    previous = sys.getprofile()
    sys.setprofile(count)
    try:
        yield
    finally:
        sys.setprofile(previous)


def train(steps: int, world: int = 1, batch_size: int = 4) -> dict[str, Any]:
    """The script's part: seed, data, model, trainer, run; what it loaded and learnt. Each of
    ``world`` ranks walks the batches of every rank up to its own, and no further."""
    torch.manual_seed(3407)
    train_dataset = SortDataset()
    model = TinyGPT()
    config = Trainer.get_default_config()
    config.learning_rate = 5e-4
    config.max_iters = steps
    config.batch_size = batch_size
    config.num_workers = 0
    trainer = Trainer(config, model, train_dataset)
    with lists_drawn_at_most(-(-world * steps * batch_size // 32) + 1):
        trainer.run()
    loaded = train_dataset.loaded
    return {"batches": [loaded[i:i + batch_size] for i in range(0, len(loaded), batch_size)],
            "loss": float(trainer.loss.item()),
            "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}
