"""The DeepSpeed config of ``sharded(engine="deepspeed")``: the user's, with the loop's values in.

A ds_config as HF users bring it (a dict, or the path of its JSON file) may say ``"auto"`` for
the values the loop decides; they are filled from the loop, as Accelerate fills them from its
arguments: the micro-batch from the first batch, the accumulation from ``accumulate()``, the
clipping from the loop's own ``clip_grad_norm_`` (checked at each step, ``zero.ZeroEngine``).
What the loop owns is set so that DeepSpeed does no more than the loop asks: accumulation is the
loop's (``managed_gradient_accumulation: false``, every ``opt.step()`` the loop takes is a
boundary), clipping is the loop's (DeepSpeed clips by default under HF's "auto" values; here
only where the loop calls ``clip_grad_norm_``), the optimizer is the loop's (also under CPU
offload). A value that contradicts the loop is refused, naming both.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError

AUTO = "auto"
# Keys of the loop's own precision: mixed_precision() decides it (DeepSpeed's fp16/bf16 modes
# keep half-precision weights, a different training from the loop's autocast).
_PRECISION_KEYS = ("fp16", "bf16", "amp", "torch_autocast")
# Parts of DeepSpeed that replace parts of the user's loop (not supported behind it yet).
_NOT_SUPPORTED = {"optimizer": "the loop's own optimizer steps (drop the \"optimizer\" section)",
                  "scheduler": "the loop's own LR scheduler steps (drop the \"scheduler\" "
                               "section)",
                  "pipeline": "DeepSpeed's pipeline engine (not supported yet)"}


def read(config: Mapping[str, Any] | str | os.PathLike[str] | None) -> dict[str, Any]:
    """The user's config as a dict of its own (a copy), read from JSON when given a path."""
    if config is None:
        return {}
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        try:
            loaded = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigurationError(
                f"sharded(engine='deepspeed', config={str(config)!r}): cannot read it as a "
                f"DeepSpeed JSON config ({exc}). Give the path of a JSON file, or a dict."
            ) from exc
        if not isinstance(loaded, dict):
            raise ConfigurationError(
                f"sharded(engine='deepspeed', config={str(config)!r}): the file holds a "
                f"{type(loaded).__name__}, not a JSON object of DeepSpeed settings.")
        return loaded
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    raise ConfigurationError(
        f"sharded(engine='deepspeed', config={config!r}): give a dict of DeepSpeed settings "
        "(a ds_config), the path of its JSON file, or None.")


def check(config: dict[str, Any], stage: int, offload: str | None) -> None:
    """Refuse, when the scope is made, what the config says against the scope or the loop."""
    for key, what in _NOT_SUPPORTED.items():
        if key in config:
            raise ConfigurationError(
                f"sharded(engine='deepspeed'): the config's {key!r} section would replace "
                f"{what}.")
    for key in _PRECISION_KEYS:
        section = config.get(key)
        if isinstance(section, Mapping) and section.get("enabled") not in (False, AUTO, None):
            raise ConfigurationError(
                f"sharded(engine='deepspeed'): the config enables {key!r}, and the precision "
                f"here is mixed_precision()'s: remove {key!r} (or set its \"enabled\" to "
                "\"auto\") and open mixed_precision(\"bf16\") around the loop instead.")
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, Mapping):
        raise ConfigurationError(
            "sharded(engine='deepspeed'): the config's \"zero_optimization\" must be an object.")
    given = zero.get("stage", AUTO)
    if given != AUTO and given != stage:
        raise ConfigurationError(
            f"sharded(engine='deepspeed', stage={stage}) and the config's zero_optimization."
            f"stage={given!r} disagree: give one of them (the config's, with stage=None).")
    device = (zero.get("offload_optimizer") or {}).get("device", AUTO)
    if device not in (AUTO, "none", None) and device != (offload or "none"):
        raise ConfigurationError(
            f"sharded(engine='deepspeed', offload={offload!r}) and the config's "
            f"zero_optimization.offload_optimizer.device={device!r} disagree: give one of them.")
    if (zero.get("offload_param") or {}).get("device", "none") not in ("none", AUTO, None):
        raise ConfigurationError(
            "sharded(engine='deepspeed'): zero_optimization.offload_param (parameter offload, "
            "ZeRO-Infinity) is not supported yet; offload='cpu' moves the optimizer's states.")


def stage_of(config: dict[str, Any]) -> int | None:
    """The ZeRO stage the config gives, if it gives one."""
    zero = config.get("zero_optimization", {})
    stage = zero.get("stage") if isinstance(zero, Mapping) else None
    return stage if isinstance(stage, int) and not isinstance(stage, bool) else None


def complete(config: dict[str, Any], *, stage: int, offload: str | None,
             micro_batch: int | None, world_size: int, accumulation: int) -> dict[str, Any]:
    """The config DeepSpeed gets: the user's, "auto" filled from the loop, and the loop's parts
    (accumulation, clipping, optimizer) left to the loop."""
    out = copy.deepcopy(config)
    for key in _PRECISION_KEYS:
        out.pop(key, None)
    given_micro = out.get("train_micro_batch_size_per_gpu", AUTO)
    if given_micro == AUTO:  # DeepSpeed counts samples with it, and trains the loop's batches
        given_micro = micro_batch or 1
    elif micro_batch is not None and given_micro != micro_batch:
        raise ConfigurationError(
            f"the DeepSpeed config's train_micro_batch_size_per_gpu={given_micro!r} and the "
            f"loop's batches of {micro_batch} (the model's first input) disagree: set it to "
            "\"auto\", or give the DataLoader that batch size.")
    out["train_micro_batch_size_per_gpu"] = given_micro
    given_gas = out.get("gradient_accumulation_steps", AUTO)
    if given_gas != AUTO and given_gas != accumulation:
        raise ConfigurationError(
            f"the DeepSpeed config's gradient_accumulation_steps={given_gas!r} and the loop's "
            f"accumulate({accumulation}) disagree (accumulate(k) is the accumulation here): set "
            f"it to \"auto\", or to {accumulation}.")
    out.pop("gradient_accumulation_steps", None)
    given_total = out.get("train_batch_size", AUTO)
    total = out["train_micro_batch_size_per_gpu"] * accumulation * world_size
    if given_total != AUTO and given_total != total:
        raise ConfigurationError(
            f"the DeepSpeed config's train_batch_size={given_total!r} and the loop disagree: "
            f"{out['train_micro_batch_size_per_gpu']} per micro-batch x accumulate("
            f"{accumulation}) x {world_size} processes = {total}. Set it to \"auto\".")
    # DeepSpeed checks micro x accumulation x world == train_batch_size: the accumulation it
    # counts is the loop's (each opt.step() the loop takes is a boundary), so it is told 1
    out["train_batch_size"] = out["train_micro_batch_size_per_gpu"] * world_size
    out["gradient_accumulation_steps"] = 1
    if accumulation > 1:  # (without accumulation, every backward is DeepSpeed's boundary)
        out["managed_gradient_accumulation"] = False
    out["gradient_clipping"] = 0.0  # the loop's clip_grad_norm_, step by step (zero.py)
    out["zero_force_ds_cpu_optimizer"] = False  # the loop's optimizer, also under offload
    out["zero_allow_untested_optimizer"] = True
    out.setdefault("steps_per_print", 2**62)  # the loop prints what it wants
    zero = dict(out.get("zero_optimization") or {})
    zero["stage"] = stage
    for key, value in list(zero.items()):
        if value == AUTO:
            del zero[key]  # DeepSpeed's own default (bucket sizes and the like)
    if offload is not None:
        zero["offload_optimizer"] = {**(zero.get("offload_optimizer") or {}), "device": offload}
    elif (zero.get("offload_optimizer") or {}).get("device") == AUTO:
        del zero["offload_optimizer"]
    out["zero_optimization"] = zero
    if accumulation > 1 and stage == 1 and zero.get("overlap_comm") is True:
        raise ConfigurationError(
            f"accumulate({accumulation}) with ZeRO-1 and the DeepSpeed config's "
            "zero_optimization.overlap_comm=true: DeepSpeed overlaps the reduction only where "
            "it partitions the gradients (stage 2 or 3) when the loop decides the accumulation "
            "boundaries. Set overlap_comm to false (or \"auto\"), or use stage=2.")
    for key, value in list(out.items()):
        if value == AUTO:
            raise ConfigurationError(
                f"the DeepSpeed config's {key!r} is \"auto\", and nothing in the loop decides "
                "it: give it a value.")
    return out


def clipping(config: dict[str, Any]) -> float | None:
    """The clipping the user's config asks for (None: "auto", or none said)."""
    value = config.get("gradient_clipping", AUTO)
    if value == AUTO:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return float(value) or None
    raise ConfigurationError(
        f"the DeepSpeed config's gradient_clipping={value!r}: give a number >= 0 or \"auto\".")
