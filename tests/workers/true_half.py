"""True half on real ranks: mixed_precision("bf16-true") under distributed() against DDP over
``model.to(torch.bfloat16)`` by hand; under sharded() (FSDP2 over half parameters) it trains,
saves, resumes and writes a model file; an engine built over fp32 weights is refused."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from accel_ctx import (
    distributed,
    load_state,
    mixed_precision,
    save_model,
    save_state,
    sharded,
    state,
)
from accel_ctx.errors import ConfigurationError

from .._timeouts import scaled
from .common import MLP, by_hand, make_data, params
from .sharded import GPT, full_weights, tokens


def _state_dtypes(opt: torch.optim.Optimizer) -> list[str]:
    """The dtypes of the optimizer's per-element state (not its step counters)."""
    return sorted({str(v.dtype) for s in opt.state.values() for v in s.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0})


def ddp_scoped(opt_after: bool) -> dict[str, Any]:
    """The plain loop under distributed() + bf16-true; the optimizer made before the first
    forward, or after it (``opt_after``)."""
    with distributed(timeout=scaled(60)), mixed_precision("bf16-true"):
        torch.manual_seed(0)
        model = MLP()
        made = [] if opt_after else [torch.optim.AdamW(model.parameters(), lr=1e-2)]
        batches, history = [], []
        for x, y in DataLoader(make_data(), batch_size=8, shuffle=True):
            batches.append((x, y))
            out = model(x)  # a float32 batch
            F.cross_entropy(out, y).backward()
            if not made:
                made.append(torch.optim.AdamW(model.parameters(), lr=1e-2))
            made[0].step()
            made[0].zero_grad()
            history.append(params(model))
        return {"batches": batches, "history": history, "out": str(out.dtype),
                "state": _state_dtypes(made[0]), "policy": state().mixed_precision}


def _ddp_by_hand(batches: list[Any]) -> list[dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = MLP().to(torch.bfloat16)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    history = []
    for x, y in batches:
        F.cross_entropy(ddp(x.to(torch.bfloat16)), y).backward()
        opt.step()
        opt.zero_grad()
        history.append(params(model))
    return history


def sharded_run(ckpt: str, *, stop: int | None = None, resume: bool = False,
                model_file: str | None = None) -> dict[str, Any]:
    """A GPT trained by the plain loop under sharded() + bf16-true, AdamW made before the
    first forward; saves at micro-batch ``stop``, or resumes from ``ckpt``."""
    with distributed(timeout=scaled(60)), sharded(), mixed_precision("bf16-true"):
        torch.manual_seed(0)
        model = GPT()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = DataLoader(tokens(), batch_size=2, shuffle=True)
        resumed = load_state(ckpt, model=model, optimizer=opt, loader=loader) if resume else None
        losses, micro = [], 0
        for _ in range(resumed.epoch if resumed else 0, 2):
            for x, y in loader:
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
                micro += 1
                if micro == stop:
                    save_state(ckpt, model=model, optimizer=opt, loader=loader)
                    return {"weights": full_weights(model)}
        if model_file is not None:
            save_model(model, model_file)
        return {"weights": full_weights(model), "losses": losses,
                "params": sorted({f"{type(p).__name__} {p.dtype}" for p in model.parameters()}),
                "state": _state_dtypes(opt), "step": state().step}


def refused() -> str:
    """A model whose DDP engine was built over its fp32 weights, then called in bf16-true."""
    with distributed(timeout=scaled(60)):
        torch.manual_seed(0)
        model = MLP()
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(state().rank))
        model(x).sum().backward()
        try:
            with mixed_precision("bf16-true"):
                model(x)
        except ConfigurationError as exc:
            return str(exc)
        return "not refused"


def run_all(root: str) -> dict[str, Any]:
    before = ddp_scoped(opt_after=False)
    after = ddp_scoped(opt_after=True)
    hand = by_hand(_ddp_by_hand, before["batches"])
    return {
        "ddp_before": before, "ddp_after": after, "ddp_hand": hand,
        "sharded_full": sharded_run(f"{root}/none", model_file=f"{root}/model.pt"),
        "sharded_stop": sharded_run(f"{root}/ckpt", stop=5),
        "sharded_resumed": sharded_run(f"{root}/ckpt", resume=True),
        "refused": refused(),
    }
