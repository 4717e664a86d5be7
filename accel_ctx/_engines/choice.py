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
from typing import Any, ClassVar

import torch
from torch import nn
from typing_extensions import override

from .._job.job import Job
from .._job.tp_plan import TensorPlan
from .._kernel.session import Session
from . import adopt as _adopt
from . import fsdp as _fsdp
from . import replicate as _replicate
from . import tensor_parallel as _tensor_parallel

Built = nn.parallel.DistributedDataParallel | _fsdp.ShardedEngine | None
"""The engine a top-level call runs through (None: the module itself)."""
Prepare = Callable[[Job, nn.Module, bool, Session], tuple[nn.Module, Built]]


class EngineChoice:
    """How the models adopted under one scope entry are laid out and run."""

    setting_up: ClassVar[str]
    """What a failing first call was doing, for the line that names the rank at fault."""
    lays_out_at_touch: ClassVar[bool] = False
    """A touch of a model before its first forward lays it out (as ``fully_shard`` would)."""
    steady_ddp: ClassVar[bool] = False
    """DDP's steady-state forward (``Concern.fast_forward``) applies."""
    prepare: Prepare
    """What to call for a top-level call of a module, and its engine (or None). The engine
    module's own function (a ``partial`` with the plan): no Python call of ours in between, as
    a top-level call runs it every step."""

    def prepare_for_load(self, job: Job, objects: dict[str, Any], session: Session) -> None:
        """Lay out the models and optimizers ``load_state`` is about to fill as training will."""
        raise NotImplementedError


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
    Manager (``_engines.fault_tolerant.ReplicaGroupRuntime``, opened beside the scope's runtime)."""

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


def choose(plan: _fsdp.ShardingPlan | None, tensor: TensorPlan | None,
           replica_groups: bool = False) -> EngineChoice:
    """The engine for a scope entry's models: the one place that looks at the kinds."""
    if replica_groups and tensor is None:  # tp= inside a group: torchft's HSDP, as below
        return ReplicaGroups() if plan is None else Sharded(plan)
    if tensor is not None:
        return TensorParallel(tensor, plan)
    if plan is not None:
        return Sharded(plan)
    return DataParallel()
