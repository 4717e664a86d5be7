"""torch.compile inside the scopes: graphs, graph breaks and recompiles, against the same model
compiled without accel_ctx (one process outside any scope; FSDP2 by hand for the sharded case),
and the weights against the same loop run eagerly under the same scopes.

Dynamo's counters are per process: each run resets them (``torch._dynamo.reset()``) and reads
how many graphs it made after its first step and at its end (a recompile adds a graph) and how
many graph breaks it met.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader

from accel_ctx import accumulate, distributed, mixed_precision, sharded

from . import common
from .sharded import GPT, tokens

BACKEND = "aot_eager"  # Dynamo and AOT autograd as inductor sees them, without inductor's C++ build
STEPS = 3


def _counts() -> tuple[int, int]:
    return sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def _loop(model: torch.nn.Module, call: Callable[..., torch.Tensor], loader: Any) -> dict[str, Any]:
    """The user's plain loop; ``call`` is what they call (the model or its compiled wrapper)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    graphs_after_first = -1
    for step, (x, y) in enumerate(loader):
        loss = F.cross_entropy(call(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step == 0:
            graphs_after_first = _counts()[1]
    breaks, graphs = _counts()
    return {"breaks": breaks, "graphs_after_first_step": graphs_after_first, "graphs": graphs,
            "weights": _full(model), "keys": sorted(model.state_dict())}


SCOPES: dict[str, Callable[[], list[contextlib.AbstractContextManager[Any]]]] = {
    "distributed": lambda: [distributed()],
    "bf16": lambda: [distributed(), mixed_precision("bf16")],
    "fp16": lambda: [distributed(), mixed_precision("fp16")],
    "accumulate": lambda: [distributed(), accumulate(2)],
    "sharded": lambda: [sharded()],
    "sharded_bf16": lambda: [sharded(), mixed_precision("bf16")],
}


def ours(scopes: str, how: str) -> dict[str, Any]:
    """The loop under ``scopes``; ``how``: "eager", "whole" (torch.compile(model) inside the
    scope), "before" (compiled before the scope opened) or "blocks" (each block's .compile())."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = GPT()
    call: Callable[..., torch.Tensor] = model
    if how == "before":
        call = torch.compile(model, backend=BACKEND)
    with contextlib.ExitStack() as open_scopes:
        for scope in SCOPES[scopes]():
            open_scopes.enter_context(scope)
        if how == "whole":
            call = torch.compile(model, backend=BACKEND)
        elif how == "blocks":
            for block in model.h:
                block.compile(backend=BACKEND)
        loader = DataLoader(tokens(8 * STEPS), batch_size=8)  # a global batch of 8, sharded
        return _loop(model, call, loader)


def _my_batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    for x, y in DataLoader(tokens(8 * STEPS), batch_size=8):
        share = 8 // world
        yield x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]


def by_hand(how: str) -> dict[str, Any]:
    """Without accel_ctx: "plain" (one process, torch.compile(model)) or "fsdp_blocks" (FSDP2 by
    hand, each block compiled in place before fully_shard, as torchtitan does)."""
    from torch.distributed.fsdp import fully_shard

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = GPT()
    if how == "plain":
        return _loop(model, torch.compile(model, backend=BACKEND), DataLoader(tokens(8 * STEPS), batch_size=8))
    for block in model.h:
        block.compile(backend=BACKEND)
        fully_shard(block)
    fully_shard(model)
    return _loop(model, model, _my_batches())


CASES = [("distributed", "whole"), ("distributed", "before"), ("bf16", "whole"), ("fp16", "whole"),
         ("accumulate", "whole"), ("sharded", "blocks"), ("sharded", "whole"),
         ("sharded_bf16", "blocks")]


def run_all() -> dict[str, Any]:
    out: dict[str, Any] = {"by_hand_plain": by_hand("plain")}
    eager: dict[str, Any] = {}
    for scopes, how in CASES:
        out[f"{scopes}/{how}"] = ours(scopes, how)
        if scopes not in eager:
            eager[scopes] = ours(scopes, "eager")
        out[f"{scopes}/eager"] = eager[scopes]
    out["by_hand_fsdp_blocks"] = common.by_hand(by_hand, "fsdp_blocks")
    out["rank"] = int(os.environ["RANK"])
    return out
