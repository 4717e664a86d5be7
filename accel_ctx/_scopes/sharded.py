"""``sharded()``: train models that do not fit one device, with the loop unchanged (FSDP2)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from typing import Any

from torch import nn
from typing_extensions import Unpack, override

from .._engines import zero_config
from .._engines.choice import Plan
from .._engines.fsdp import BlockSpec, ShardingPlan
from .._engines.zero import ZeroPlan, check_installed
from .._hooks.scope import Scope
from .._job.options import DistributedOptions, Options, parse_options
from .._kernel.concern import Concern
from .._options import checked, flag
from ..errors import ConfigurationError
from .distributed import DistributedRuntime, open_runtime

__all__ = ["sharded"]


_OWN = ("blocks", "reshard_after_forward", "cpu_offload", "shard_size", "hybrid", "engine",
        "stage", "offload", "config")
_ENGINES = ("fsdp2", "deepspeed")
_FSDP2_DEFAULTS = {"blocks": None, "reshard_after_forward": True, "cpu_offload": False,
                   "shard_size": None, "hybrid": False}


@checked
class sharded(Scope):
    """Shard the parameters, gradients and optimizer states of the models over the ranks.

    Inside the scope a model's first call shards it with torch's FSDP2 (``fully_shard``), or,
    where the script touches the model before that (``model.parameters()`` for an optimizer,
    ``state_dict()``, ``load_state_dict()``, DCP's ``get_model_state_dict``/``set_model_state_dict``),
    that first touch does, so the script sees DTensors as after a hand-written ``fully_shard``: each
    block on its own (found automatically: the repeated children of a ``ModuleList`` or
    ``Sequential``, e.g. transformer layers; or given by ``blocks``), then the whole model.
    Every rank starts from rank 0's weights; optimizers made before or after follow the model
    to its sharded parameters, with their settings and state. The rest of the loop is as under
    ``distributed()``, which ``sharded()`` opens itself when no job is open yet:
    ``mixed_precision("bf16")`` gathers the parameters in bf16 and reduces gradients in fp32
    (FSDP2's ``MixedPrecisionPolicy``, fixed when the model is sharded); ``accumulate()`` and
    ``no_sync()`` skip the reduce-scatter between boundaries; ``clip_grad_norm_`` clips by the
    global norm; ``save_state`` writes each rank's shards and loads onto any number of ranks;
    ``save_model`` gathers the full weights to rank 0.

    ``model`` stays the same object with the same ``state_dict()`` keys, but its class becomes
    FSDP2's subclass of yours (``isinstance`` still holds) and its parameters become shards
    (``DTensor``): read full weights with ``save_model`` inside the scope. The model stays
    sharded after the scope ends, on a process group that is gone: use it inside the scope.

    A model built on ``torch.device("meta")`` and touched before its first forward is sharded on
    meta at that touch, as ``fully_shard`` would (``model.to_empty(device=...)`` and FSDP2's
    methods such as ``set_modules_to_forward_prefetch`` count), for the script to give it values
    as FSDP2's scripts do: ``to_empty`` and ``reset_parameters()``, or a full state dict loaded
    with ``assign=True`` or DCP's ``set_model_state_dict``. What is still on meta at its first
    forward gets its values there: each module's ``reset_parameters()`` runs in module order,
    from rank 0's random stream (one process's values), block by block, so no rank ever holds
    the whole model.

    ``engine="deepspeed"`` trains with DeepSpeed's ZeRO instead (``pip install
    'accel-ctx[deepspeed]'``), the loop unchanged: the model's first call with gradients builds
    its DeepSpeed engine with the optimizer made for it (make the optimizer before that call);
    ``opt.step()`` is the engine's step, ``clip_grad_norm_`` clips in it (the returned norm is
    filled by that step), ``accumulate(k)`` decides its boundaries, ``mixed_precision("bf16")``
    autocasts its forward; ``save_model`` writes the full weights (ZeRO-3: gathered).
    ``save_state``/``load_state``/``resumable()`` write the same full-state checkpoint as under
    FSDP2 or DDP (one format across engines); fp16 loss scaling and half weights are refused.

    Args:
        blocks: the classes of the submodules to shard on their own, or a predicate
            ``fn(module) -> bool``; None finds the repeated layers.
        reshard_after_forward: free the gathered parameters after each block's forward (and
            gather again in backward): less memory, more communication. An int reshards to
            groups of that many ranks (FSDP2's option).
        cpu_offload: keep the shards, gradients and optimizer step on the CPU (GPU jobs).
        shard_size: shard each copy of the model over this many ranks and replicate the copies
            (HSDP; under ``tp``, data-parallel ranks); None shards over all ranks.
        hybrid: HSDP with one copy per machine (``shard_size`` = processes per node; with
            ``tp``, its data-parallel ranks: processes per node / ``tp``).
        engine: ``"fsdp2"`` (the default: torch's ``fully_shard``) or ``"deepspeed"``.
        stage: DeepSpeed's ZeRO stage: 1 (optimizer states partitioned), 2 (and gradients),
            3 (and parameters); None takes the config's, else 2.
        offload: ``"cpu"``: DeepSpeed keeps the optimizer's states and step on the CPU.
        config: a DeepSpeed config (dict, or the path of its JSON file) as HF users bring it;
            its ``"auto"`` values are filled from the loop, and a value that contradicts the
            loop is refused.
        **options: ``distributed()`` options, used when this scope forms the job.

    Examples:
        >>> import torch
        >>> from accel_ctx import distributed, sharded, state
        >>> with distributed(), sharded():
        ...     model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        ...     opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ...     model(torch.randn(3, 4)).sum().backward()
        ...     opt.step()
        ...     print(state().world_size)
        1
    """

    def __init__(self, *, blocks: Sequence[type[nn.Module]] | type[nn.Module]
                 | Callable[[nn.Module], bool] | None = None,
                 reshard_after_forward: bool | int = True, cpu_offload: bool = False,
                 shard_size: int | None = None, hybrid: bool = False, engine: str = "fsdp2",
                 stage: int | None = None, offload: str | None = None,
                 config: Mapping[str, Any] | str | os.PathLike[str] | None = None,
                 **options: Unpack[Options]) -> None:
        super().__init__()
        self.options: DistributedOptions = parse_options(options, "sharded", _OWN)
        self.plan: Plan
        if engine == "deepspeed":
            given = {"blocks": blocks, "reshard_after_forward": reshard_after_forward,
                     "cpu_offload": cpu_offload, "shard_size": shard_size, "hybrid": hybrid}
            _refuse_given(given, _FSDP2_DEFAULTS, "engine='deepspeed'", "FSDP2's")
            self.plan = _zero_plan(stage, offload, config)
            return
        if engine != "fsdp2":
            raise ConfigurationError(
                f"sharded(engine={engine!r}): give one of {', '.join(map(repr, _ENGINES))}.")
        _refuse_given({"stage": stage, "offload": offload, "config": config},
                      dict.fromkeys(("stage", "offload", "config")), "engine='fsdp2'",
                      "DeepSpeed's (engine='deepspeed')")
        self.plan = ShardingPlan(_blocks(blocks), _reshard(reshard_after_forward),
                                 flag("sharded", "cpu_offload", cpu_offload),
                                 _shard_size(shard_size), flag("sharded", "hybrid", hybrid))

    @override
    def _open(self, exits: ExitStack) -> DistributedRuntime | tuple[Concern, ...]:
        return open_runtime(self.options, exits, self.plan)


def _refuse_given(given: Mapping[str, object], defaults: Mapping[str, object], engine: str,
                  whose: str) -> None:
    for name, value in given.items():
        if value is not defaults[name] and value != defaults[name]:
            raise ConfigurationError(
                f"sharded({engine}, {name}={value!r}): {name} is one of {whose} options, which "
                f"this engine does not take; drop it (or choose the engine it belongs to).")


def _zero_plan(stage: object, offload: object, config: object) -> ZeroPlan:
    check_installed()
    settings = zero_config.read(config)  # type: ignore[arg-type]
    if stage is None:
        stage = zero_config.stage_of(settings) or 2
    if stage not in (1, 2, 3) or isinstance(stage, bool):
        raise ConfigurationError(
            f"sharded(engine='deepspeed', stage={stage!r}): give ZeRO's stage 1 (optimizer "
            "states partitioned), 2 (and gradients) or 3 (and parameters).")
    if offload not in (None, "cpu"):
        raise ConfigurationError(
            f"sharded(engine='deepspeed', offload={offload!r}): give \"cpu\" (the optimizer's "
            "states and step on the CPU) or None; NVMe offload is not supported yet.")
    assert isinstance(stage, int)
    zero_config.check(settings, stage, offload if isinstance(offload, str) else None)
    return ZeroPlan(stage, offload if isinstance(offload, str) else None, settings)


def _blocks(blocks: object) -> BlockSpec:
    if blocks is None:
        return None
    if isinstance(blocks, type):
        blocks = [blocks]
    if isinstance(blocks, (list, tuple, set, frozenset)):
        classes = tuple(blocks)
        if classes and all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            return classes
    elif callable(blocks):
        return blocks
    raise ConfigurationError(
        f"sharded(blocks={blocks!r}): give the module classes to shard on their own "
        "(blocks=[MyBlock]), a function module -> bool, or None to find the repeated layers.")


def _reshard(value: object) -> bool | int:
    if isinstance(value, bool) or (isinstance(value, int) and value >= 1):
        return value
    raise ConfigurationError(
        f"sharded(reshard_after_forward={value!r}): give True, False, or a number of ranks >= 1.")


def _shard_size(value: object) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ConfigurationError(
        f"sharded(shard_size={value!r}): give a number of ranks >= 1 that divides the world "
        "size, or None to shard over every rank.")
