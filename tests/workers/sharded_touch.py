"""pytorch/examples' FSDP2 example, migrated to ``sharded()`` (its ``fully_shard`` calls removed),
against the same script by hand (``fully_shard`` on every layer, then the model).

The script touches the model between building it and its first forward as the example does:
it reads every parameter's placement (``inspect_model``), loads a checkpoint through one of its
two paths (DCP's ``set_model_state_dict`` of a full state dict broadcast from rank 0, or DTensors
built from ``model.state_dict()``'s meshes and placements, loaded with ``assign=True``), builds
Adam over ``model.parameters()``, trains 4 steps and saves through the same path.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from accel_ctx import distributed, load_state, save_state, sharded

from .._timeouts import scaled
from .common import hand_group

VOCAB, DIM, LAYERS, SEQ, BATCH = 32, 16, 3, 8, 4


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        # counted inside __init__, as nanoGPT does: the model is not complete yet
        self.size = sum(p.numel() for p in self.parameters())
        self.norm = nn.LayerNorm(DIM)
        self.out = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for layer in self.layers:
            x = layer(x)
        return self.out(self.norm(x))


def placements(model: nn.Module) -> list[str]:
    """The example's inspect_model: what each parameter says of its placement."""
    return [f"{type(p).__name__}:{getattr(p, 'placements', None)}" for p in model.parameters()]


def load(model: nn.Module, full: dict[str, torch.Tensor], path: str) -> None:
    """The example's Checkpointer.load_model, both of its paths."""
    if path == "dcp":
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        set_model_state_dict(model, full, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))
        return
    from torch.distributed.tensor import distribute_tensor

    meta_sharded = model.state_dict()
    sharded_sd = {}
    for name, value in full.items():
        like = meta_sharded[name]
        sharded_sd[name] = nn.Parameter(distribute_tensor(value, like.device_mesh, like.placements))
    model.load_state_dict(sharded_sd, strict=False, assign=True)


def save(model: nn.Module, path: str) -> dict[str, torch.Tensor]:
    """The example's Checkpointer.save: the full weights, through the same path."""
    if path == "dcp":
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                    cpu_offload=True))
    return {name: value.full_tensor() for name, value in model.state_dict().items()}


def script(path: str, by_hand: bool, full: dict[str, torch.Tensor]) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Transformer()
    if by_hand:
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    seen = placements(model)
    load(model, full, path)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    rank = dist.get_rank()
    torch.manual_seed(2 + rank)  # the example draws each rank's batch on that rank
    losses = []
    for _ in range(4):
        x = torch.randint(0, VOCAB, (BATCH, SEQ))
        loss = model(x).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return {"placements": seen, "weights": save(model, path), "losses": losses}


def meta_resumed(folder: str, steps: int, stop: int | None) -> dict[str, torch.Tensor]:
    """A model built on meta, Adam made over it (the touch that shards it on meta), trained
    ``steps`` steps; saved at ``stop`` and, when a checkpoint is there, resumed from it first."""
    with distributed(timeout=scaled(60)), sharded():
        torch.manual_seed(0)
        with torch.device("meta"):
            model = Transformer()
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        start = load_state(folder, model=model, optimizer=optim).step if stop is None else 0
        g = torch.Generator().manual_seed(3 + dist.get_rank())
        batches = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(steps)]
        for step in range(start, stop if stop is not None else steps):
            model(batches[step]).sum().backward()
            optim.step()
            optim.zero_grad()
        if stop is not None:
            save_state(folder, model=model, optimizer=optim)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def example(folder: str | None = None) -> dict[str, Any]:
    # the checkpoint the example loads (torch.load of a full state dict; DCP changes the dict)
    torch.manual_seed(1)
    full = {k: torch.randn_like(v) for k, v in Transformer().state_dict().items()}
    out: dict[str, Any] = {}
    with hand_group("touch"):
        for path in ("dcp", "dtensor"):
            out[f"{path} by hand"] = script(path, by_hand=True, full=dict(full))
    for path in ("dcp", "dtensor"):
        with distributed(timeout=scaled(60)), sharded():
            out[f"{path} sharded()"] = script(path, by_hand=False, full=dict(full))
    if folder is not None:
        out["meta whole"] = meta_resumed(os.path.join(folder, "whole"), 4, None)
        meta_resumed(os.path.join(folder, "halves"), 4, 2)
        out["meta resumed"] = meta_resumed(os.path.join(folder, "halves"), 4, None)
    return out
