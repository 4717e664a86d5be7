"""mixed_precision("fp8") workers: a GPT-shaped model (nanoGPT's, every Linear a multiple of 16)
trained by the plain loop in bf16 and in fp8, on one rank, on two (DDP) and sharded (FSDP2), with
checkpoints and torchao's low-bit optimizers.

The loop is the user's: the optimizer is made before the first forward (it must keep training
the converted layers' parameters), no torchao call anywhere; the scopes do the conversion.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

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

from .nanogpt import GPT, GPTConfig, get_batch

STEPS = 50
LOSS_TOLERANCE = 0.05
"""fp8's mean loss over the last 10 of 50 steps is within 5 % of bf16's (measured: under 1 %)."""
CONFIG = GPTConfig(vocab_size=64, n_embd=32, n_head=2, n_layer=2, block_size=16)
WIDE = GPTConfig(vocab_size=64, n_embd=64, n_head=2, n_layer=2, block_size=16)
"""For the low-bit optimizers: torchao quantizes a state of 4096 values or more (a shard's)."""
LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def model_and_optimizer(optimizer: str = "adamw") -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(CONFIG if optimizer == "adamw" else WIDE)
    if optimizer == "adamw":
        return model, torch.optim.AdamW(model.parameters(), lr=3e-3)
    from torchao.optim import AdamW4bit, AdamW8bit

    low_bit = {"adamw8bit": AdamW8bit, "adamw4bit": AdamW4bit}[optimizer]
    return model, low_bit(model.parameters(), lr=3e-3)


@contextlib.contextmanager
def engine(kind: str) -> Iterator[None]:
    scope = {"one": contextlib.nullcontext(), "ddp": distributed(), "fsdp": sharded()}[kind]
    with scope:
        yield


def step(model: nn.Module, optimizer: torch.optim.Optimizer, batches: torch.Generator) -> float:
    x, y = get_batch(batches)
    _, loss = model(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return float(loss.item())


def full(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's full weights, as plain tensors (gathered when sharded)."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone().float()
            for k, v in model.state_dict().items()}


def train(kind: str, policy: str, steps: int = STEPS, optimizer: str = "adamw",
          **fp8: Any) -> dict[str, Any]:
    """The user's loop: model and optimizer made first, then ``steps`` steps in the scopes."""
    model, opt = model_and_optimizer(optimizer)
    params_before = [id(p) for p in model.parameters()]
    with engine(kind), mixed_precision(policy, **fp8):
        batches = torch.Generator().manual_seed(100 + rank())
        losses = [step(model, opt, batches) for _ in range(steps)]
        layers = {type(model.transformer.h[0].get_submodule(n)).__name__ for n in LINEARS}
        weight = model.transformer.h[0].mlp.c_fc.weight
        local = getattr(weight, "_local_tensor", weight)
        out = {"losses": losses, "layers": layers, "keys": list(model.state_dict()),
               "lm_head": type(model.lm_head).__name__, "weight": type(local).__name__,
               "same_params": kind != "fsdp" and [id(p) for p in model.parameters()]
               == params_before,
               "optimizer_follows": {id(p) for g in opt.param_groups for p in g["params"]}
               == {id(p) for p in model.parameters()},
               "world": state().world_size}
    return out


def resume(kind: str, folder: Path, optimizer: str = "adamw") -> dict[str, list[str]]:
    """6 steps in fp8 saving after the 3rd, and a fresh model and optimizer that load that
    checkpoint and take the last 3 steps: the weights and the optimizer's state (a low-bit
    optimizer's codes and scales) agree bit for bit. Low-bit optimizers run their step eagerly
    here (torchao compiles it per parameter shape: minutes on a CPU with a cold cache)."""

    fp8: dict[str, Any] = {}
    if kind == "fsdp" and optimizer != "adamw":  # low-bit: no float8 all-gathers (refused)
        from torchao.float8 import Float8LinearConfig

        fp8["fp8_config"] = Float8LinearConfig()

    def run(load: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        model, opt = model_and_optimizer(optimizer)
        batches = torch.Generator().manual_seed(7 + rank())
        with torch.compiler.set_stance("force_eager"), engine(kind), mixed_precision(
                "fp8", **fp8):
            if load:
                load_state(folder, required=True, model=model, optimizer=opt)
                for _ in range(3):
                    get_batch(batches)  # the batches the saved run had drawn
            for i in range(3 if load else 6):
                step(model, opt, batches)
                if i == 2 and not load:
                    save_state(folder, model=model, optimizer=opt)
            return full(model), optimizer_parts(opt)

    straight = run(load=False)
    resumed = run(load=True)
    return {"weights": differ(straight[0], resumed[0]),
            "optimizer": differ(straight[1], resumed[1]),
            "low_bit": sorted({k.rsplit(".", 1)[-1] for k in straight[1]})}


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def optimizer_parts(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the optimizer's state, a low-bit state by its parts (codes, scales)."""
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}
    for i, per_param in enumerate(opt.state.values()):
        for key, value in per_param.items():
            if not isinstance(value, torch.Tensor):
                continue
            value = value.to_local() if isinstance(value, DTensor) else value
            if type(value) is torch.Tensor:
                out[f"{i}.{key}"] = value
            else:  # torchao's OptimState8bit / 4bit: compare what it is made of
                for part in value.__tensor_flatten__()[0]:
                    out[f"{i}.{key}.{part}"] = getattr(value, part)
    return out


def differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The keys whose tensors differ (empty: bit-identical)."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return [k for k in a if not torch.equal(a[k], b[k])]


def load_plain(path: Path) -> dict[str, torch.Tensor]:
    """The file as a user loads it: torch.load reads a .safetensors file from torch 2.13 on (the
    check there stays torch.load's); an older torch needs safetensors' own loader."""
    torch_version = tuple(map(int, torch.__version__.split(".")[:2]))
    if path.suffix == ".safetensors" and torch_version < (2, 13):
        from safetensors.torch import load_file

        return load_file(path)
    loaded: dict[str, torch.Tensor] = torch.load(path, weights_only=True)
    return loaded


def saved_model_loads_plain(kind: str, path: Path) -> dict[str, Any]:
    model, opt = model_and_optimizer()
    batches = torch.Generator().manual_seed(3 + rank())
    with engine(kind), mixed_precision("fp8"):
        step(model, opt, batches)
        weights = full(model)
        save_model(model, path)
        save_state(path.parent / "ckpt", model=model, optimizer=opt)
    plain = GPT(CONFIG)
    result = plain.load_state_dict(load_plain(path))
    return {"missing": list(result.missing_keys), "unexpected": list(result.unexpected_keys),
            "differ": differ(weights, {k: v.float() for k, v in plain.state_dict().items()}),
            "types": {type(v).__name__ for v in load_plain(path).values()}}


def two_ranks(folder: str) -> dict[str, Any]:
    """Every multi-process check of tests/precision/test_fp8.py, in one spawned run of 2 ranks."""
    root = Path(folder)
    out: dict[str, Any] = {}
    # the bf16 reference once (DDP): sharded() trains the same model on the same batches
    for kind, policy in (("ddp", "bf16"), ("ddp", "fp8"), ("fsdp", "fp8")):
        out[kind, policy] = train(kind, policy)
    out["resume", "fsdp"] = resume("fsdp", root / "fsdp", "adamw8bit")
    try:  # the float8 all-gather weights crash torchao's compiled step: refused before it
        train("fsdp", "fp8", steps=1, optimizer="adamw4bit")
    except ConfigurationError as exc:
        out["low_bit_refused"] = str(exc)
    out["resume", "ddp"] = resume("ddp", root / "ddp", "adamw4bit")
    out["plain"] = saved_model_loads_plain("fsdp", root / "model" / "model.safetensors")
    model, batch = GPT(CONFIG), get_batch(torch.Generator().manual_seed(rank()))
    with sharded():
        with mixed_precision("bf16"):
            model(*batch)  # sharded in bf16
        try:
            with mixed_precision("fp8"):  # too late to convert: refused, on every rank
                model(*batch)
        except ConfigurationError as exc:
            out["sharded_first"] = str(exc)
    try:
        with distributed(tp=2), mixed_precision("fp8"):
            GPT(CONFIG)(*get_batch(torch.Generator().manual_seed(0)))
    except ConfigurationError as exc:
        out["tp"] = str(exc)
    return out
