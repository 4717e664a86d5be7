"""Workers of tests/accumulation/test_fidelity_engines.py: sharded models whose parameters mix dtypes."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

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
from .sharded import full_weights

WIDTH = 16


class Block(nn.Module):
    """A bf16 Linear beside an fp32 LayerNorm (as models that keep their norms in fp32)."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x.to(self.ln.weight.dtype))  # each part computes in its own dtype
        return x + self.fc(h.to(self.fc.weight.dtype)).to(x.dtype)


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, WIDTH)
        self.h = nn.ModuleList(Block() for _ in range(3))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.to(self.embed.weight.dtype)).float()
        for block in self.h:
            h = block(h)
        h = self.norm(h.to(self.norm.weight.dtype))
        return self.head(h.to(self.head.weight.dtype)).float()


def mixed_model(upcast: bool = False) -> Mixed:
    """Linears in bf16, LayerNorms in fp32; ``upcast``: the same model made fp32 by hand."""
    torch.manual_seed(0)
    model = Mixed()
    for part in (model.embed, model.head, *(b.fc for b in model.h)):
        part.to(torch.bfloat16)
    return model.float() if upcast else model


def data(n: int = 48) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def _dtypes(tensors: Any) -> list[str]:
    return sorted({str(t.dtype).removeprefix("torch.") for t in tensors
                   if isinstance(t, torch.Tensor) and t.dim() > 0})


def train(batch: int, *, upcast: bool = False, opt_after: bool = False, scope: str = "sharded",
          save: str | None = None) -> dict[str, Any]:
    """The plain loop on the mixed model under ``scope`` ("sharded": with distributed();
    "one process": sharded() alone) and mixed_precision('bf16');
    "autocast": one process, torch.autocast by hand; "hand": FSDP2 by hand on the model upcast
    by hand (fully_shard per block, then the root, MixedPrecisionPolicy(bf16, fp32 reduce)),
    under torch.autocast, in distributed() for the data only."""
    hand = scope in ("autocast", "hand")
    with contextlib.ExitStack() as stack:
        if scope in ("sharded", "hand"):
            stack.enter_context(distributed(timeout=scaled(60)))
        if scope in ("sharded", "one process"):
            stack.enter_context(sharded())
        if not hand:
            stack.enter_context(mixed_precision("bf16"))
        model = mixed_model(upcast or hand)
        if scope == "hand":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for block in model.h:
                fully_shard(block, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
        make = lambda: torch.optim.AdamW(model.parameters(), lr=0.01)  # noqa: E731
        opt = None if opt_after else make()
        for x, y in DataLoader(data(), batch_size=batch, shuffle=True):
            with torch.autocast("cpu", torch.bfloat16) if hand else contextlib.nullcontext():
                out = model(x)
            if opt is None:
                opt = make()
            F.cross_entropy(out, y).backward()
            opt.step()
            opt.zero_grad()
        result = {"weights": full_weights(model) if scope in ("sharded", "hand")
                  else {k: v.detach().clone() for k, v in model.state_dict().items()},
                  "step": state().step,
                  "master": _dtypes(model.parameters()),
                  "state_dict": _dtypes(model.state_dict().values()),
                  "opt_state": _dtypes(v for s in opt.state.values() for v in s.values()),
                  "opt_follows": {id(p) for g in opt.param_groups for p in g["params"]}
                  == {id(p) for p in model.parameters()}}
        if save is not None:
            save_model(model, f"{save}/model.pt")
            save_state(f"{save}/ckpt", model=model, opt=opt)
        return result


def mixed_dtypes(batch: int, root: str) -> dict[str, Any]:
    """On W ranks: the mixed model refused without a precision scope, upcast under one."""
    out: dict[str, Any] = {}
    with distributed(timeout=scaled(60)), sharded():
        model = mixed_model()
        try:
            model(torch.randn(2, 6))
            out["refused"] = None
        except ConfigurationError as exc:
            out["refused"] = str(exc)
        out["refused_left"] = _dtypes(model.parameters())  # nothing changed, nothing sharded
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["auto"] = train(batch, save=root)
    out["warned"] = [str(w.message) for w in caught if "upcast" in str(w.message)]
    out["auto_after"] = train(batch, opt_after=True)
    out["by_hand"] = train(batch, upcast=True)
    out["fsdp_by_hand"] = train(batch, scope="hand")
    # a fresh mixed model and optimizer resume from the checkpoint: upcast, then loaded
    with distributed(timeout=scaled(60)), sharded(), mixed_precision("bf16"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = mixed_model()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        load_state(f"{root}/ckpt", model=model, opt=opt)
        out["resumed"] = full_weights(model)
        out["resumed_opt_state"] = _dtypes(v for s in opt.state.values() for v in s.values())
        x, y = data()[:batch]
        F.cross_entropy(model(x), y).backward()
        opt.step()  # trains on from there
        out["resumed_step"] = state().step
    return out
