"""The engine models train with, chosen in one place: DDP, FSDP2, or tensor parallelism.

A ``distributed()`` or ``sharded()`` entry asks :func:`choose` once, from its sharding plan and
its tensor-parallel plan, and keeps the answer. Everything that lays a model out asks that
object and never branches on the kind: a top-level call (``prepare``), ``load_state`` about to
fill models and optimizers (``prepare_for_load``) and a touch of a model before its first
forward (``_engines.touch``, where ``lays_out_at_touch``). A new engine (fault-tolerant replica
groups) is one more class here and one more line in :func:`choose`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any, ClassVar

import torch
from torch import nn
from typing_extensions import override

from .._job.job import Job
from .._job.tp_plan import TensorPlan
from .._kernel.checkpoint_form import CheckpointForm
from .._kernel.concern import Concern
from .._kernel.session import Session
from ..errors import ConfigurationError
from . import adopt as _adopt
from . import fsdp as _fsdp
from . import pipeline as _pipeline
from . import replicate as _replicate
from . import tensor_parallel as _tensor_parallel
from . import zero as _zero
from .replica_client import Healing

Built = nn.parallel.DistributedDataParallel | _fsdp.ShardedEngine | _zero.ZeroEngine | None
"""The engine a top-level call runs through (None: the module itself)."""
Plan = _fsdp.ShardingPlan | _zero.ZeroPlan
"""How ``sharded()`` lays models out: FSDP2's plan, or DeepSpeed's."""
Prepare = Callable[[Job, nn.Module, bool, Session], tuple[nn.Module, Built]]


class EngineChoice:
    """How the models adopted under one scope entry are laid out and run."""

    setting_up: ClassVar[str]
    """What a failing first call was doing, for the line that names the rank at fault."""
    lays_out_at_touch: ClassVar[bool] = False
    """A touch of a model before its first forward lays it out (as ``fully_shard`` would)."""
    steady_ddp: ClassVar[bool] = False
    """DDP's steady-state forward (``Concern.fast_forward``) applies."""
    owns_step: ClassVar[bool] = False
    """The engine takes the optimizer's steps and clips in them (``run_step``, ``clip_in_step``)."""
    prepare: Prepare
    """What to call for a top-level call of a module, and its engine (or None). The engine
    module's own function (a ``partial`` with the plan): no Python call of ours in between, as
    a top-level call runs it every step."""

    def prepare_for_load(self, job: Job, objects: dict[str, Any], session: Session) -> None:
        """Lay out the models and optimizers ``load_state`` is about to fill as training will."""
        raise NotImplementedError

    def run_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Take ``optimizer``'s decided step in the engine (where ``owns_step``)."""
        return False

    def allows_zero_grad(self, owner: Any) -> bool:
        """Whether ``owner.zero_grad()`` may clear its gradients (where ``owns_step``)."""
        return True

    def clip_in_step(self, max_norm: float, norm_type: float) -> torch.Tensor | None:
        """Clip in the engine's coming step (where ``owns_step``): the norm's tensor, or None."""
        return None

    def full_state_dict(self, module: nn.Module) -> dict[str, Any] | None:
        """``module``'s full weights where DCP cannot gather them (collective), else None."""
        return None

    def checkpoint_form(self, obj: Any) -> CheckpointForm | None:
        """The form the engine keeps ``obj``'s state in, for checkpoints (None: DCP's own)."""
        return None

    across_groups: Callable[[], Healing] | None = None
    """The job is one replica group: the last step of the layout averages across the groups
    (torchft's Manager), healing a returning peer from the state this makes."""

    def open(self, job: Job, exits: ExitStack) -> tuple[Concern, ...]:
        """The runtimes this engine opens beside the scope's own, when the scope forms the job
        (across replica groups: the Manager, whatever the engine inside the group); undone by
        ``exits``."""
        if self.across_groups is None:
            return ()
        from . import fault_tolerant  # torchft: only in a replica group

        return (fault_tolerant.ReplicaGroupRuntime(job, exits, self.across_groups()),)


class DataParallel(EngineChoice):
    """``distributed()``: DDP, built at a model's first call with gradients."""

    setting_up = "setting up DDP"
    steady_ddp = True

    def __init__(self) -> None:
        self.prepare = _replicate.prepare

    @override
    def prepare_for_load(self, job: Job, objects: dict[str, Any], session: Session) -> None:
        # moved to the job's device, so that loaded optimizer states live there
        if job.device.type == "cpu":
            return
        for obj in objects.values():
            if isinstance(obj, nn.Module):
                tensors = [*obj.parameters(), *obj.buffers()]
                if tensors and all(t.device.type == "cpu" for t in tensors):
                    obj.to(job.device)


class ReplicaGroups(DataParallel):
    """``distributed()`` in a replica group (``accel-ctx launch --replica-groups``): DDP inside
    the group; across the groups the gradients are averaged and each step committed by torchft's
    Manager (``_engines.fault_tolerant.ReplicaGroupRuntime``, which :meth:`open` opens beside
    the scope's runtime, as for every engine inside a group)."""

    setting_up = "setting up DDP in a replica group"


class _Splits(EngineChoice):
    """An engine that replaces the parameters (shards or splits them): laid out before a load
    (each rank then reads only its part) or a touch, and the optimizers pointed at them."""

    lays_out_at_touch = True

    @override
    def prepare_for_load(self, job: Job, objects: dict[str, Any], session: Session) -> None:
        for obj in objects.values():
            if isinstance(obj, nn.Module):
                self.prepare(job, obj, True, session)
        for obj in objects.values():
            if isinstance(obj, torch.optim.Optimizer):
                _adopt.adopt_optimizer(job, obj)


class Sharded(_Splits):
    """``sharded()``: FSDP2 (``fully_shard``), blocks first, then the root."""

    setting_up = "sharding the model"

    def __init__(self, plan: _fsdp.ShardingPlan) -> None:
        self.prepare = functools.partial(_fsdp.prepare, plan=plan)


class TensorParallel(_Splits):
    """``tp=N``: the plan's layers split over "tp", then FSDP2 over "dp" under ``sharded()``."""

    setting_up = "splitting the model over tp"

    def __init__(self, tensor: TensorPlan, plan: _fsdp.ShardingPlan | None) -> None:
        self.prepare = functools.partial(_tensor_parallel.prepare, tensor=tensor, sharding=plan)


class Pipeline(EngineChoice):
    """``pp=N``: each model cut into stages, run by GPipe behind the loop (``_engines.pipeline``),
    DDP over "dp" on each stage."""

    setting_up = "cutting the model into pipeline stages"

    def __init__(self) -> None:
        self.prepare = _pipeline.prepare

    @override
    def prepare_for_load(self, job: Job, objects: dict[str, Any], session: Session) -> None:
        for obj in objects.values():  # cut first: each stage then reads only its part
            if isinstance(obj, nn.Module):
                self.prepare(job, obj, True, session)
        for obj in objects.values():
            if isinstance(obj, torch.optim.Optimizer):
                _adopt.adopt_optimizer(job, obj)

    @override
    def full_state_dict(self, module: nn.Module) -> dict[str, Any] | None:
        return _pipeline.full_state_dict(module)


class DeepSpeedZero(EngineChoice):
    """``sharded(engine="deepspeed")``: DeepSpeed's ZeRO engine (``_engines.zero``), built at a
    model's first call with gradients, which then takes the loop's steps and clipping."""

    setting_up = "setting up DeepSpeed"
    owns_step = True

    def __init__(self, plan: _zero.ZeroPlan) -> None:
        self.prepare = functools.partial(_zero.prepare, plan=plan)

    @override
    def prepare_for_load(self, job: Job, objects: dict[str, Any], session: Session) -> None:
        for obj in objects.values():  # the engines built: the state is loaded into them
            if isinstance(obj, nn.Module):
                self.prepare(job, obj, True, session)

    @override
    def checkpoint_form(self, obj: Any) -> CheckpointForm | None:
        return _zero.form_of(obj)

    @override
    def full_state_dict(self, module: nn.Module) -> dict[str, Any] | None:
        return _zero.full_state_dict(module)

    @override
    def run_step(self, optimizer: torch.optim.Optimizer) -> bool:
        engine = _zero.engine_of(optimizer)
        if engine is None:
            return False
        engine.step()
        return True

    @override
    def allows_zero_grad(self, owner: Any) -> bool:
        # DeepSpeed pointed the optimizer at its own partitions, whose gradient buffers it
        # keeps (CPU offload) and clears itself after each step, as it does the model's
        return not isinstance(owner, torch.optim.Optimizer) or _zero.engine_of(owner) is None

    @override
    def clip_in_step(self, max_norm: float, norm_type: float) -> torch.Tensor | None:
        built = _zero.engines()
        if not built:
            return None  # not built yet (one process): torch's clipping
        if norm_type != 2.0:
            raise ConfigurationError(
                f"clip_grad_norm_(norm_type={norm_type}) under sharded(engine='deepspeed'): "
                "DeepSpeed clips by the 2-norm only; drop norm_type.")
        norm = torch.full((), float("nan"))
        for engine in built:
            engine.clip, engine.norm = max_norm, norm
        return norm


def choose(plan: Plan | None, tensor: TensorPlan | None,
           healing: Callable[[], Healing] | None = None, stages: int = 1) -> EngineChoice:
    """The engine for a scope entry's models: the one place that looks at the kinds.
    ``healing``: the job is one replica group (it makes the state a returning peer gets);
    ``stages``: the pipeline's (``pp=``)."""
    if stages > 1:
        if plan is not None or healing is not None:
            raise ConfigurationError(
                f"pp={stages} " + ("with sharded()" if plan is not None else
                                   "under --replica-groups") + " is not supported yet: use "
                f"distributed(pp={stages}) (DDP over the data-parallel ranks of each stage).")
        return Pipeline()
    if isinstance(plan, _zero.ZeroPlan):
        if tensor is not None or healing is not None:
            raise ConfigurationError(
                "sharded(engine='deepspeed') trains with DeepSpeed's own data parallelism, "
                "and " + ("tp=" if tensor is not None else "replica groups (--replica-groups)")
                + " is not supported with it yet: use sharded() (FSDP2), which composes with "
                "both.")
        return DeepSpeedZero(plan)
    # the layout inside the job (a replica group: tp= then FSDP2 inside is torchft's HSDP)...
    chosen: EngineChoice
    if tensor is not None:
        chosen = TensorParallel(tensor, plan)
    elif plan is not None:
        chosen = Sharded(plan)
    else:
        chosen = DataParallel() if healing is None else ReplicaGroups()
    chosen.across_groups = healing  # ...then, in a replica group, across the groups
    return chosen
