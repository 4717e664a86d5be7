"""The DDP engine: what a top-level call of an adopted module runs under ``distributed()``.

A model is adopted (``_engines.adopt``) at its first top-level call; its ``DistributedDataParallel``
engine is built at the first call with gradients enabled (a broadcast of rank 0's weights), and
decided once: a model with nothing to train, or a single process, gets none. Calls without
gradients run the module itself, so an evaluation or a preview in rank-only code runs no
collective that other ranks would have to join.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._job.comm_hook import torch_hook
from .._job.job import Job
from .._kernel import state as _state
from .._kernel.session import Session
from .._warn import warn_user
from ..errors import ConfigurationError
from . import adopt as _adopt
from . import fsdp as _fsdp
from . import records as _records
from .join import LAST_FORWARD, refuse_forward

_BUFFER_SYNC_FLAG = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(nn.parallel.DistributedDataParallel).parameters
    else "broadcast_buffers"
)


def prepare(job: Job, module: nn.Module, grad: bool, session: Session | None = None
            ) -> tuple[nn.Module, nn.parallel.DistributedDataParallel | _fsdp.ShardedEngine | None]:
    """What to call for a top-level call of ``module``, and its DDP engine (or None)."""
    record = _records.module_record(module)
    if record is None or record.owner is not job.root:
        if isinstance(module, nn.parallel.DistributedDataParallel):
            return module, module  # the user's own DDP: leave it to them
        if _adopt.managed_elsewhere(module):
            return module, None
        record = _adopt.adopt(job, module)
    if isinstance(record.engine, _fsdp.ShardedEngine):  # sharded earlier in this job
        _fsdp.check_call(job, module, grad)
        return module, record.engine
    if not record.root:  # a part of an adopted model, called on its own
        # (not a recomputation: activation checkpointing runs a part again in the backward)
        if grad and job.world_size > 1 and torch._C._current_autograd_node() is None:
            _check_part(job, module)
        return module, None
    if not grad:
        return module, None
    adoption = job.adoption
    if _state.rank_only() is not None and job.world_size > 1:
        # Rank-only code: DDP's collectives would wait for ranks that never come. Run the
        # module itself; a backward through it is refused (DistributedRuntime.before_backward).
        job.progress.armed = bool(record.engine) or (
            record.engine is None and _trainable(module))
        return module, None
    if adoption.uneven_tail is not None and (record.engine or (
            record.engine is None and _trainable(module))):
        refuse_forward(adoption)
    if record.engine is None:  # decided once, at the first call that records gradients
        record.engine = _engine_for(job, module) or False
    engine = record.engine
    if not isinstance(engine, nn.parallel.DistributedDataParallel):
        return module, None
    # steady_engine() ends the same way: a change here belongs there too
    adoption.forwards += 1
    engine.__dict__[LAST_FORWARD] = adoption.forwards
    return engine, engine


def steady_engine(job: Job, module: nn.Module) -> nn.parallel.DistributedDataParallel | None:
    """``prepare``'s answer, with its bookkeeping, for the call a training loop makes every step:
    gradients on, of an adopted model whose DDP engine is built, its first inputs checked, no
    rank-only code, no uneven tail. None, having changed nothing, for any other call."""
    record = _records.module_record(module)
    if (record is None or record.owner is not job.root or not record.root
            or type(record.engine) is not nn.parallel.DistributedDataParallel):
        return None
    adoption = job.adoption
    if (not adoption.inputs_checked or adoption.uneven_tail is not None
            or not torch.is_grad_enabled() or _state.rank_only() is not None):
        return None
    engine = record.engine
    # prepare()'s own last lines, written out: a shared helper would cost a call every step
    adoption.forwards += 1
    engine.__dict__[LAST_FORWARD] = adoption.forwards
    return engine


def _trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def _check_part(job: Job, part: nn.Module) -> None:
    checked = job.adoption.parts_checked
    if part in checked:
        return
    checked.add(part)
    if job.rank == 0 and _trainable(part):
        warn_user(
            f"a {type(part).__name__} inside an adopted model was called on its own with "
            "gradients enabled: DDP averages gradients only for calls of the whole model, "
            "so the gradients of this call stay local to each rank and the ranks drift "
            "apart. Call the model itself (move this use into its forward), or wrap the "
            "call in torch.no_grad() if no gradients are needed.",
            RuntimeWarning)


def _engine_for(job: Job, module: nn.Module) -> nn.parallel.DistributedDataParallel | None:
    if not (_trainable(module) and job.world_size > 1 and dist.is_initialized()):
        return None
    adoption = job.adoption
    if job.options.sync_batchnorm and job.device.type in ("cuda", "xpu"):
        adoption.undo_batchnorm.extend(_convert_batchnorm(module))
    elif job.options.sync_batchnorm and not adoption.warned_batchnorm:
        adoption.warned_batchnorm = True
        if job.rank == 0:
            warn_user(
                f"distributed(sync_batchnorm=True): SyncBatchNorm cannot run on "
                f"{job.device.type}; BatchNorm statistics stay per rank here. It takes "
                "effect on CUDA devices.",
                RuntimeWarning)
    return build_ddp(job, module)


def build_ddp(job: Job, module: nn.Module, group: Any = None
              ) -> nn.parallel.DistributedDataParallel:
    """DDP over ``module`` with the scope's options, averaging over ``group`` (None: the job's;
    a pipeline stage: its "dp" ranks)."""
    opts = job.options
    devices = {p.device for p in module.parameters()}
    single_cuda = len(devices) == 1 and next(iter(devices)).type == "cuda"
    kwargs: dict[str, Any] = {}
    if opts.bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = opts.bucket_cap_mb
    if not opts.broadcast_buffers:  # newer torch renamed the flag
        kwargs[_BUFFER_SYNC_FLAG] = False
    ddp = nn.parallel.DistributedDataParallel(
        module,
        device_ids=[next(iter(devices))] if single_cuda else None,
        find_unused_parameters=opts.find_unused_parameters,
        gradient_as_bucket_view=opts.gradient_as_bucket_view,
        static_graph=opts.static_graph,
        process_group=group,
        **kwargs,
    )
    if opts.comm_hook is not None:
        ddp.register_comm_hook(*torch_hook(opts.comm_hook))
    return ddp


def _convert_batchnorm(module: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """Swap BatchNorm children for SyncBatchNorm in place; returns how to undo it."""
    undo: list[tuple[nn.Module, str, nn.Module]] = []
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.modules.batchnorm._BatchNorm) and not isinstance(
                child, nn.SyncBatchNorm
            ):
                sync = nn.SyncBatchNorm.convert_sync_batchnorm(child)  # type: ignore[no-untyped-call]
                setattr(parent, name, sync)
                undo.append((parent, name, child))
    return undo


def explain_unused_parameters(job: Job, exc: BaseException) -> None:
    """DDP's error at the step after one where some parameters got no gradient names its own
    constructor's option, which the user never calls: raise it again naming ours."""
    if "find_unused_parameters=True" not in str(exc) or job.options.find_unused_parameters:
        return
    raise ConfigurationError(
        f"rank {job.rank}: the model has parameters that took no part in the previous step's "
        "loss (a branch not taken, a layer left out of forward), so DDP never finished "
        "averaging their gradients and cannot start a new step. Fix: "
        "distributed(find_unused_parameters=True) (DDP's option of that name), or set "
        "requires_grad=False on the parameters the forward never uses."
    ) from exc
