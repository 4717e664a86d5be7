"""Adopting modules into a job: the engine-neutral part.

A module's first top-level call inside ``distributed()`` adopts it: it moves to the job's
device (unless the user placed it), it and its parts get a ``ModuleRecord`` naming the root job
as owner, and it joins the job's :class:`~accel_ctx._job.job.Adoption`. Optimizers made before a
move that replaced parameters are pointed at the new ones when first met. The data-parallel
engine (``_engines.replicate``; FSDP2 next) then decides what runs.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch
from torch import nn

from .._job.job import Job
from .._kernel import state as _state
from .._kernel.tree import to_device
from . import records as _records


def adopt(job: Job, module: nn.Module, move: bool = True) -> _records.ModuleRecord:
    """Adopt ``module`` (and its parts) into the job; returns its root record. ``move=False``
    leaves placing it to the engine (the sharded one moves it block by block)."""
    stack = _state.current()
    for concern in stack.concerns if stack is not None else ():
        concern.adopting(module)  # before the move: a model cast to half moves half the bytes
    root_job = job.root
    for sub in module.modules():
        record = _records.module_record(sub)
        if sub is not module and record is not None and record.root and record.owner is root_job:
            release(job, sub)  # a part was called first; the whole model takes over
    if move:
        move_to_device(job, module)
    root = _records.ModuleRecord(root_job, True)
    for sub in module.modules():
        _records.set_module_record(
            sub, root if sub is module else _records.ModuleRecord(root_job, False))
    job.adoption.modules.add(module)
    return root


def root_record(job: Job, module: nn.Module, move: bool = True) -> _records.ModuleRecord | None:
    """``module``'s adoption record as a model an engine lays out (adopted now if it was not),
    or None where it is none: the user's own engine (their DDP, a composable API) or a part of
    an adopted model (the engine's hooks on the whole cover it)."""
    record = _records.module_record(module)
    if record is None or record.owner is not job.root:
        if isinstance(module, nn.parallel.DistributedDataParallel) or managed_elsewhere(module):
            return None
        record = adopt(job, module, move=move)
    return record if record.root else None


def move_to_device(job: Job, module: nn.Module) -> None:
    """Move ``module`` to the job's device, unless the user placed it (or it is on meta)."""
    if job.device.type == "cpu":
        return
    devices = {t.device.type for t in module.parameters()}
    devices.update(t.device.type for t in module.buffers())
    if devices != {"cpu"}:  # modules the user placed themselves stay where they are
        return
    before = dict(module.named_parameters())
    module.to(job.device)
    # Some devices (meta, XLA, ...) get new Parameter objects: optimizers made before the
    # move are pointed at them when accel_ctx first meets the optimizer.
    record_replaced(job, before, module)


def record_replaced(job: Job, before: dict[str, nn.Parameter], module: nn.Module) -> None:
    """Note which of ``before`` (name -> parameter) ``module`` now holds as new objects, for
    :func:`adopt_optimizer` to point optimizers at them."""
    for name, param in module.named_parameters():
        old = before.get(name)
        if old is not None and old is not param:
            job.adoption.replaced[id(old)] = (weakref.ref(old), param)


def adopt_optimizer(job: Job, optimizer: torch.optim.Optimizer) -> None:
    """Point an optimizer at moved or sharded parameters; its state follows them."""
    replaced = job.adoption.replaced
    state: dict[Any, Any] = optimizer.state
    for group in optimizer.param_groups:
        kept = []
        for old in group["params"]:
            entry = replaced.get(id(old))
            if entry is None or entry[0]() is not old:
                kept.append(old)
                continue
            old_param, new = entry[0](), entry[1]
            assert old_param is not None  # checked just above
            if new is None:  # another pipeline stage holds it: this one no longer steps it
                state.pop(old, None)
                continue
            kept.append(new)
            if old in state:
                state[new] = _like(state.pop(old), old_param, new)
        group["params"][:] = kept
    if job.device.type == "cpu":
        return
    for param, state in optimizer.state.items():
        for key, value in state.items():
            # 0-dim "step" counters of some optimizers stay on the CPU on purpose
            moves = isinstance(value, torch.Tensor) and value.dim() > 0
            if moves and value.device != param.device:
                state[key] = value.to(param.device)


def _like(state: dict[str, Any], old: torch.Tensor, new: torch.Tensor) -> dict[str, Any]:
    """An optimizer state of ``old`` laid out as ``new``: sharded alike when ``new`` is a
    shard (each rank keeps its part of what every rank holds in full; no communication), and
    in ``new``'s dtype when the engine upcast the parameter (``_engines.fsdp_dtypes``)."""
    if new.dtype != old.dtype:
        state = {key: value.to(new.dtype) if isinstance(value, torch.Tensor)
                 and value.dtype == old.dtype and value.shape == old.shape and value.dim() > 0
                 else value for key, value in state.items()}
    mesh = getattr(new, "device_mesh", None)
    if mesh is None:
        return state
    from torch.distributed.tensor import distribute_tensor

    placements = new.placements  # type: ignore[attr-defined]
    return {key: distribute_tensor(value.to(new.device), mesh, placements, src_data_rank=None)
            if isinstance(value, torch.Tensor) and value.shape == old.shape and value.dim() > 0
            else value for key, value in state.items()}


def inputs_to_device(job: Job, args: tuple[Any, ...], kwargs: dict[str, Any]
                     ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if job.device.type == "cpu":
        return args, kwargs
    return to_device(args, job.device), to_device(kwargs, job.device)


def release(job: Job, module: nn.Module) -> None:
    """Forget ``module``'s adoption (its records and its engine)."""
    for sub in module.modules():
        record = _records.module_record(sub)
        if record is not None and record.owner is job.root:
            _records.set_module_record(sub, None)
    job.adoption.modules.discard(module)


def release_all(job: Job) -> None:
    """The job ends: undo what adoption changed and drop every engine."""
    adoption = job.adoption
    for parent, name, original in reversed(adoption.undo_batchnorm):
        setattr(parent, name, original)
    adoption.undo_batchnorm.clear()
    engines = False
    for module in list(adoption.modules):
        record = _records.module_record(module)
        engines = engines or (record is not None and bool(record.engine))
        release(job, module)
    if engines:
        # DDP engines sit in reference cycles; free them (and the process group they hold)
        # now, before the group is destroyed, rather than at interpreter shutdown, where
        # gloo's teardown can abort the process.
        gc.collect()


def managed_elsewhere(module: nn.Module) -> bool:
    """Modules that torch's composable APIs (replicate, fully_shard) or DataParallel manage.

    Asked once per module, when accel_ctx first meets it: a model whose root or any part is
    under a composable API keeps that engine and gets none of ours on top of it.
    """
    if isinstance(module, nn.DataParallel):
        return True
    if composable_apis(module):
        return True
    return any(type(module).__name__.startswith(p) for p in ("FSDP", "FullyShardedDataParallel"))


def composable_apis(module: nn.Module) -> list[str]:
    """Names of torch composable APIs applied to ``module`` or its parts ('replicate', ...).

    Read from torch's own registry (``torch.distributed._composable.contract._get_registry``),
    where ``replicate()`` and ``fully_shard()`` record themselves on each module they manage.
    """
    try:
        from torch.distributed._composable.contract import _get_registry
    except ImportError:  # a torch build without distributed: nothing can be applied
        return []
    names: list[str] = []
    for sub in module.modules():
        registry = _get_registry(sub)
        if registry:
            names.extend(name for name in registry if name not in names)
    return names
