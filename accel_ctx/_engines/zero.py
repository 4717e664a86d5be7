"""DeepSpeed ZeRO behind the plain loop: ``sharded(engine="deepspeed", stage=1|2|3)``.

A model's first call with gradients builds its DeepSpeed engine (``deepspeed.initialize``) with
the optimizer the script made over its parameters, from rank 0's weights, as DDP starts. Then
the loop's own calls go to the engine: ``model(x)`` runs the engine's forward; ``loss.backward()``
is the engine's backward (DeepSpeed takes a plain backward: its hooks on the model's output);
``opt.step()`` runs ``engine.step()`` (DeepSpeed's reduction of the gradients, then the
optimizer's step on the partitions); ``clip_grad_norm_`` clips in that step, by the norm over
every rank's partition; ``accumulate(k)`` holds ``opt.step()`` back as under DDP, and each step
the loop takes is DeepSpeed's accumulation boundary (its unmanaged accumulation). DeepSpeed
itself does nothing the loop does not ask for (``zero_config``).
"""

from __future__ import annotations

import gc
import importlib.util
import sys
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._job.job import Job
from .._kernel import state as _state
from .._kernel.session import Session
from ..errors import ConfigurationError
from . import adopt as _adopt
from . import records as _records
from . import zero_config as _config
from . import zero_state as _forms
from .fsdp import broadcast_from_rank0, check_call

EXTRA = "pip install 'accel-ctx[deepspeed]'"


@dataclass(frozen=True)
class ZeroPlan:
    """How ``sharded(engine="deepspeed")`` asks adopted models to be trained."""

    stage: int
    offload: str | None
    config: dict[str, Any]


def check_installed() -> None:
    """Refuse ``engine="deepspeed"`` where DeepSpeed is not installed, naming the extra."""
    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigurationError(
            f"sharded(engine='deepspeed') needs DeepSpeed, which is not installed: {EXTRA} "
            "(or pip install deepspeed), or use sharded() (FSDP2: reshard_after_forward=True "
            "is ZeRO-3's layout, False ZeRO-2's).")


class ZeroEngine:
    """An adopted model's DeepSpeed engine, seen through the switch the other concerns use."""

    def __init__(self, ds: Any, module: nn.Module, optimizer: torch.optim.Optimizer,
                 groups: list[list[torch.Tensor]], config_clip: float | None) -> None:
        self.ds = ds
        self.optimizer = weakref.ref(optimizer)
        # checkpoints read and write both in a plain model's and optimizer's form
        self.model_form = _forms.ModelForm(module)
        self.optimizer_form = _forms.OptimizerForm(module, optimizer, groups, ds.optimizer)
        self.config_clip = config_clip
        self.clip: float | None = None  # the loop's clip_grad_norm_ max_norm in this step
        self.norm: torch.Tensor | None = None  # what that call returned, filled by the step

    @property
    def require_backward_grad_sync(self) -> bool:
        """Always: DeepSpeed reduces at the steps the loop takes (its unmanaged accumulation)."""
        return True

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        pass  # accumulate() holds opt.step() back; DeepSpeed's boundary is the step taken

    def step(self) -> None:
        """``engine.step()``, clipped as the loop asked in this step."""
        clip = self.clip
        if self.config_clip is not None and clip != self.config_clip:
            said = (f"clip_grad_norm_(..., max_norm={clip})" if clip is not None
                    else "no clip_grad_norm_")
            raise ConfigurationError(
                f"the DeepSpeed config's gradient_clipping={self.config_clip} and the loop "
                f"({said} in this step) disagree: the loop's clipping is the clipping here; set "
                "gradient_clipping to \"auto\" in the config.")
        zero_optimizer = self.ds.optimizer
        zero_optimizer.clip_grad = clip or 0.0
        try:
            self.ds.step()
        finally:
            zero_optimizer.clip_grad = 0.0
            self.clip = None
        norm, self.norm = self.norm, None
        if norm is not None:
            value = self.ds.get_global_grad_norm()
            norm.fill_(float("nan") if value is None else float(value))


_BY_OPTIMIZER: weakref.WeakKeyDictionary[torch.optim.Optimizer, ZeroEngine] = (
    weakref.WeakKeyDictionary())


def engine_of(optimizer: torch.optim.Optimizer) -> ZeroEngine | None:
    """The DeepSpeed engine ``optimizer`` steps under, if any."""
    return _BY_OPTIMIZER.get(optimizer)


def engines() -> list[ZeroEngine]:
    """Every DeepSpeed engine built in this process (a clip call finds its own among them)."""
    return list(_BY_OPTIMIZER.values())


def release() -> None:
    """The job ends: forget its engines, and DeepSpeed's cached process groups with them (its
    own teardown, ``deepspeed.comm.destroy_process_group``, would end torch's group too)."""
    if not _BY_OPTIMIZER:
        return
    _BY_OPTIMIZER.clear()
    groups = sys.modules.get("deepspeed.utils.groups")
    forget = getattr(groups, "_release_process_group_references", None)
    if forget is not None:
        forget(None)


def prepare(job: Job, module: nn.Module, grad: bool, session: Session, *, plan: ZeroPlan
            ) -> tuple[nn.Module, ZeroEngine | None]:
    """What to call for a top-level call of ``module``, and its DeepSpeed engine (or None)."""
    record = _adopt.root_record(job, module)
    if record is None:
        return module, None  # the user's own engine, or a part of the model
    if record.engine is None:
        if not grad or (_state.rank_only() is not None and job.world_size > 1):
            return module, None  # built at the first training call, on every rank
        record.engine = build(job, module, plan, session) or False
    engine = record.engine
    if isinstance(engine, nn.parallel.DistributedDataParallel):
        raise ConfigurationError(
            f"this {type(module).__name__} already trains with DDP in this job: its first call "
            "with gradients ran under distributed() without sharded(engine='deepspeed'). Open "
            "it before the model's first call.")
    if not isinstance(engine, ZeroEngine):
        return module, None
    if plan.stage == 3:
        check_call(job, module, grad)  # its forward gathers the partitions from every rank
    return engine.ds, engine


def build(job: Job, module: nn.Module, plan: ZeroPlan, session: Session) -> ZeroEngine | None:
    """``deepspeed.initialize`` over ``module`` and the optimizer the script made for it.
    None on one process: nothing to partition, the model trains as it is."""
    if job.world_size == 1 or not dist.is_initialized():
        return None
    optimizer = _optimizer_of(module, session)
    import deepspeed  # slow to import, and optional

    driving = session.driving_loader()
    batch_size = getattr(driving.loader, "batch_size", None) if driving is not None else None
    micro_batch = batch_size if isinstance(batch_size, int) else None
    config = _config.complete(plan.config, stage=plan.stage, offload=plan.offload,
                              micro_batch=micro_batch, world_size=job.world_size,
                              accumulation=_accumulation())
    _refuse_half(module)
    broadcast_from_rank0(job, module)  # every rank starts from rank 0's weights, as DDP
    groups = [list(group["params"]) for group in optimizer.param_groups]  # before DeepSpeed's
    _own_world_group(job)
    ds, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config,
                                       dist_init_required=False)
    engine = ZeroEngine(ds, module, optimizer, groups, _config.clipping(plan.config))
    _BY_OPTIMIZER[optimizer] = engine
    return engine


def _own_world_group(job: Job) -> None:
    """DeepSpeed reduces on its own copy of the world group, made with torch's default timeout
    (30 minutes): made here with the job's, a stalled peer is named within distributed()'s
    timeout as under DDP. DeepSpeed keeps it until the job releases its groups (``release``)."""
    from deepspeed.utils import groups

    if getattr(groups, "_WORLD_GROUP", None) is None:
        groups._WORLD_GROUP = dist.new_group(ranks=list(range(job.world_size)),
                                             timeout=job.root.options.timeout)


def _refuse_half(module: nn.Module) -> None:
    """fp16 loss scaling and half-precision weights are DeepSpeed's own modes, not supported
    behind the loop yet: refused before they could train wrong (a GradScaler would unscale
    gradients DeepSpeed keeps in its partitions, and skip nothing)."""
    stack = _state.current()
    scaled = any(c.loss_scaling() is not None for c in (stack.concerns if stack else ()))
    half = next((p.dtype for p in module.parameters() if p.dtype != torch.float32), None)
    if scaled or half is not None:
        what = "fp16's loss scaling" if scaled else f"{half} weights"
        raise ConfigurationError(
            f"sharded(engine='deepspeed') with {what} is not supported yet (DeepSpeed keeps "
            "the gradients in its own partitions): use mixed_precision(\"bf16\") (autocast, "
            "fp32 weights), or sharded() (FSDP2), which trains with fp16 and true half.")


def form_of(obj: Any) -> _forms.ModelForm | None:
    """The checkpoint form of a model or optimizer a DeepSpeed engine trains, or None."""
    if isinstance(obj, torch.optim.Optimizer):
        engine = _BY_OPTIMIZER.get(obj)
        return engine.optimizer_form if engine is not None else None
    if isinstance(obj, nn.Module):
        record = _records.module_record(obj)
        built = record.engine if record is not None else None
        return built.model_form if isinstance(built, ZeroEngine) else None
    return None


def _accumulation() -> int:
    """The group size of the ``accumulate()`` open around the loop (1: none)."""
    stack = _state.current()
    for concern in stack.concerns if stack is not None else ():
        size = concern.accumulation_steps()
        if size is not None:
            return size
    return 1


def _optimizer_of(module: nn.Module, session: Session) -> torch.optim.Optimizer:
    """The one optimizer over ``module``'s parameters (met by the session, or made by the
    script before the model's first call), refused where there is none or several."""
    params = {id(p) for p in module.parameters() if p.requires_grad}
    candidates = list(session.optimizers.keys())
    if not candidates:
        # by type, not isinstance: a lazy proxy among the objects would load (and warn)
        candidates = [o for o in gc.get_objects() if issubclass(type(o), torch.optim.Optimizer)]
    found = [o for o in candidates
             if any(id(p) in params for g in o.param_groups for p in g["params"])]
    name = type(module).__name__
    if not found:
        raise ConfigurationError(
            f"sharded(engine='deepspeed'): no optimizer over this {name}'s parameters exists at "
            "its first call, and DeepSpeed partitions the optimizer with the model: make the "
            "optimizer (torch.optim.AdamW(model.parameters(), ...)) before the first forward.")
    if len(found) > 1:
        raise ConfigurationError(
            f"sharded(engine='deepspeed'): {len(found)} optimizers step this {name}'s "
            f"parameters ({', '.join(type(o).__name__ for o in found)}), and a DeepSpeed engine "
            "takes one: give the model one optimizer (several parameter groups are fine).")
    optimizer = found[0]
    theirs = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if not theirs <= params:
        raise ConfigurationError(
            f"sharded(engine='deepspeed'): the {type(optimizer).__name__} over this {name} also "
            "steps parameters of another model, and a DeepSpeed engine takes one model with "
            "its optimizer: give each model its own optimizer.")
    return optimizer


def full_state_dict(module: nn.Module) -> dict[str, Any] | None:
    """ZeRO-3's full weights of ``module`` gathered to rank 0 (collective; empty elsewhere),
    or None where its engine keeps them whole (stages 1 and 2)."""
    record = _records.module_record(module)
    engine = record.engine if record is not None else None
    if not isinstance(engine, ZeroEngine) or engine.ds.zero_optimization_stage() != 3:
        return None
    state: dict[str, Any] | None = engine.ds._zero3_consolidated_16bit_state_dict()
    return state if state is not None else {}
