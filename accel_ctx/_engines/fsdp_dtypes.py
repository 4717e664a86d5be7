"""Sharded models whose trainable parameters mix dtypes (a bf16 Linear beside an fp32 LayerNorm).

FSDP2 gathers and reduces the trainable parameters of each unit it shards (a block, then the
root's own) as one group, in one dtype: a unit that mixes dtypes fails inside torch at the first
forward. ``distributed()`` trains such a model as it is, so ``sharded()`` must not simply crash:

- under a mixed-precision scope, the trainable parameters become fp32 master weights (the widest
  dtype among them, at least fp32), as Accelerate and Lightning do for FSDP; FSDP2's
  ``MixedPrecisionPolicy`` still gathers them in the scope's compute dtype, and gradients are
  reduced in fp32. The upcast gives them new ``Parameter`` objects, recorded in the job's
  adoption with the sharding, so every optimizer (made before or after) follows them, its state
  cast alike. What the model saves (``state_dict()``, ``save_state``, ``save_model``) is then
  fp32;
- without one there is no compute dtype to train in: refuse, naming the dtypes, the modules, and
  the fixes.

Frozen parameters keep their dtype (FSDP2 checks the trainable ones only), and so does a model
whose units are each of one dtype.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .._warn import warn_user
from ..errors import ConfigurationError

Unit = tuple[str, list[tuple[str, nn.Parameter]]]
"""A unit FSDP2 shards: its name and its own trainable parameters (qualified names)."""


def settle_dtypes(module: nn.Module, blocks: list[nn.Module], compute: torch.dtype | None,
                  warn: bool) -> None:
    """Give each unit of ``module`` (``blocks``, innermost first, then the root) one dtype of
    trainable parameters before it is sharded, or refuse; ``compute``: the scope's compute dtype."""
    units = _units(module, blocks)
    mixed = [unit for unit in units if len({p.dtype for _, p in unit[1]}) > 1]
    if not mixed:
        return
    where = _describe(mixed)
    name = type(module).__name__
    if compute is None:
        raise ConfigurationError(
            f"sharded() cannot shard this {name}: FSDP2 keeps the trainable parameters of each "
            f"block it shards in one dtype, but {where}. Give the model one dtype before its "
            "first call (model.float(), or model.to(torch.bfloat16)), or open "
            "mixed_precision('bf16') (or 'fp16') around it: sharded() then trains fp32 master "
            "weights and computes in the scope's dtype.")
    target = functools.reduce(torch.promote_types,
                              (p.dtype for _, params in units for _, p in params), torch.float32)
    upcast = _upcast(module, target)
    if warn and upcast:
        warn_user(
            f"sharded(): {name}'s trainable parameters mix dtypes ({where}); {upcast} of them "
            f"were upcast to {_short(target)} master weights, computed in {_short(compute)} "
            f"(mixed_precision), as FSDP2 needs one dtype per block. The model's state_dict(), "
            f"save_state and save_model hold {_short(target)} weights; cast the model to one "
            "dtype before its first call to keep another.")


def _units(module: nn.Module, blocks: list[nn.Module]) -> list[Unit]:
    """The units fully_shard makes: each block's parameters not in an inner block, then the
    root's rest (trainable ones only, as FSDP2's dtype check)."""
    names = {id(p): n for n, p in module.named_parameters()}
    modules = {id(m): n for n, m in module.named_modules()}
    taken: set[int] = set()
    units: list[Unit] = []
    for unit in [*blocks, module]:
        own: list[tuple[str, nn.Parameter]] = []
        for param in unit.parameters():
            if id(param) not in taken:
                taken.add(id(param))
                if param.requires_grad:
                    own.append((names.get(id(param), "?"), param))
        units.append((modules.get(id(unit)) or "the root module", own))
    return units


def _describe(mixed: list[Unit]) -> str:
    """'h.0 holds torch.bfloat16 (h.0.fc) and torch.float32 (h.0.ln)', and how many more."""
    unit, params = mixed[0]
    owners: dict[torch.dtype, list[str]] = {}
    for qualified, param in params:
        owner = qualified.rpartition(".")[0] or qualified
        listed = owners.setdefault(param.dtype, [])
        if owner not in listed:
            listed.append(owner)
    parts = []
    for dtype, listed in owners.items():
        shown = ", ".join(listed[:3]) + (f", ... ({len(listed)} modules)" if len(listed) > 3 else "")
        parts.append(f"{dtype} ({shown})")
    more = f" (and {len(mixed) - 1} more like it)" if len(mixed) > 1 else ""
    return f"{unit} holds " + " and ".join(parts) + more


def _upcast(module: nn.Module, target: torch.dtype) -> int:
    """Replace every trainable parameter not in ``target`` by a new one in it (ties kept, and
    the attributes users set on parameters); returns how many were replaced."""
    made: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for key, param in list(sub._parameters.items()):
            if param is None or not param.requires_grad or param.dtype == target:
                continue
            new = made.get(id(param))
            if new is None:
                new = nn.Parameter(param.detach().to(target), requires_grad=True)
                new.__dict__.update(param.__dict__)
                made[id(param)] = new
            sub._parameters[key] = new
    return len(made)


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
