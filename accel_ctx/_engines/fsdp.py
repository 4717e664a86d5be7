"""The FSDP2 engine: what a top-level call of an adopted module runs under ``sharded()``.

A model's first top-level call outside rank-only code adopts it (``_engines.adopt``, without the move:
the engine moves it piece by piece) and shards it with torch's ``fully_shard``: each block
first (the repeated children of a ``ModuleList``/``Sequential``, or the ones the plan names),
then the root. Every rank starts from rank 0's weights, broadcast block by block before each is
sharded, as DDP does for the whole model. A model built on ``meta`` is materialised module by
module in module order, each initialised by its ``reset_parameters()`` from rank 0's random
stream (every rank draws the same numbers, so the shards form one model, and rank 0 draws what
one process would), and each block is sharded as soon as it is complete: no rank ever holds
more than the root's own parameters and one block in full. Touched before its first forward
(``_engines.touch``), it is sharded on meta instead, as ``fully_shard`` would, for the script to
give it values (``to_empty``, a loaded state dict); ``_engines.fsdp_meta`` has both paths.

``fully_shard`` replaces the parameters with sharded ones; the old ones are recorded in the
job's :class:`~accel_ctx._job.job.Adoption` so that every optimizer, made before or after, is
pointed at the new ones (``_engines.adopt.adopt_optimizer``), its existing state sharded alike.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._job.job import Job
from .._kernel import state as _state
from .._kernel.session import Session
from ..errors import ConfigurationError, DistributedError
from . import adopt as _adopt
from . import fsdp_meta as _meta
from .fsdp_dtypes import settle_dtypes
from .join import refuse_forward

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
_as_built = threading.local()  # .on: sharding at a touch, a meta model stays on meta
BlockSpec = tuple[type[nn.Module], ...] | Callable[[nn.Module], bool] | None
"""Which submodules are sharded on their own: classes, a predicate, or None (found)."""


@dataclass(frozen=True)
class ShardingPlan:
    """How ``sharded()`` asks adopted models to be sharded."""

    blocks: BlockSpec = None
    reshard_after_forward: bool | int = True
    cpu_offload: bool = False
    shard_size: int | None = None
    """Ranks one copy of the model is sharded over (None: all); fewer gives HSDP."""
    hybrid: bool = False
    """HSDP with one copy per machine: shard within a node, replicate across nodes."""


class ShardedEngine:
    """An adopted model's FSDP2 engine, seen through the switch the other concerns use."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._sync = True

    @property
    def require_backward_grad_sync(self) -> bool:
        """Whether the next backward reduce-scatters the gradients (FSDP2's own switch)."""
        return self._sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        if value != self._sync:
            self.switch_sync(value)
            self._sync = value

    def switch_sync(self, value: bool) -> None:  # the engine's own switch
        self.module.set_requires_gradient_sync(value)  # type: ignore[operator]


def prepare(job: Job, module: nn.Module, grad: bool, session: Session, *, plan: ShardingPlan
            ) -> tuple[nn.Module, ShardedEngine | None]:
    """What to call for a top-level call of ``module``, and its sharded engine (or None)."""
    record = _adopt.root_record(job, module, move=False)  # records only: nothing moves yet
    if record is None:
        return module, None  # the user's own engine, or a part (its block hooks gather it)
    if record.engine is None:
        if _state.rank_only() is not None and job.world_size > 1:
            return module, None  # not sharded yet, and sharding is collective: wait for all
        record.engine = shard(job, module, plan, session) or False
    engine = record.engine
    if isinstance(engine, nn.parallel.DistributedDataParallel):
        raise ConfigurationError(
            f"this {type(module).__name__} already trains with DDP in this job: its first call "
            "with gradients ran under distributed() without sharded(). Open sharded() before "
            "the model's first call (with distributed(), sharded(): ...).")
    if not isinstance(engine, ShardedEngine):
        return module, None
    check_call(job, module, grad)
    if _meta.waiting_models and _meta.waiting(module) and not getattr(_as_built, "on", False):
        _meta.give_values(job, module, session)  # sharded on meta at a touch: values now
    return module, engine


@contextlib.contextmanager
def sharding_as_built() -> Iterator[None]:
    """While open (a touch lays the model out), a model built on ``meta`` is sharded on meta, as
    ``fully_shard`` would: the script gives it values (``_engines.fsdp_meta``)."""
    before = getattr(_as_built, "on", False)
    _as_built.on = True
    try:
        yield
    finally:
        _as_built.on = before


def check_call(job: Job, module: nn.Module, grad: bool) -> None:
    """Refuse a call of a sharded model that would hang: in rank-only code (its forward
    gathers from every rank) or in an uneven last round that no Join covers."""
    if job.world_size > 1 and _state.rank_only() is not None:
        raise DistributedError(
            f"a sharded {type(module).__name__} was called in rank-only code (on_main_process "
            "& co.): its forward gathers the parameters from every rank, which would wait "
            "forever for the ranks that do not run this code. Call the model on every rank "
            "(and keep only the printing or saving rank-only).")
    if job.adoption.uneven_tail is not None and grad:
        refuse_forward(job.adoption)


def shard(job: Job, module: nn.Module, plan: ShardingPlan, session: Session
          ) -> ShardedEngine | None:
    """Shard ``module`` (blocks, then root) and point the known optimizers at its new
    parameters; materialise it first if it was built on ``meta``. None: nothing to shard."""
    meta = any(t.is_meta for t in chain(module.parameters(), module.buffers()))
    sharding = (dist.is_available() and dist.is_initialized() and job.world_size > 1
                and any(True for _ in module.parameters()))
    if meta:
        _meta.check_meta_init(module)
    _check_blocks(module, plan.blocks)
    before = dict(module.named_parameters())
    settle_dtypes(module, find_blocks(module, plan.blocks), compute_dtype(), job.rank == 0)
    stack = _state.current()
    for concern in stack.concerns if sharding and stack is not None else ():
        concern.before_sharding(module)  # fp8: its weights wrapped to gather in float8
    if sharding:
        _shard(job, module, plan, meta)
    elif meta:  # one process: nothing to shard, but the model must exist
        _meta.materialise(module, [], job.device, lambda block: None)
    else:
        _adopt.move_to_device(job, module)  # as distributed() would
    _adopt.record_replaced(job, before, module)
    for optimizer in list(session.optimizers.keys()):
        _adopt.adopt_optimizer(job, optimizer)  # met before: point them at the new parameters
    return ShardedEngine(module) if sharding else None


def _shard(job: Job, module: nn.Module, plan: ShardingPlan, meta: bool) -> None:
    from torch.distributed.fsdp import fully_shard

    options = shard_options(job, plan)
    blocks = find_blocks(module, plan.blocks)

    def shard_block(block: nn.Module) -> None:
        fully_shard(block, **options)

    if meta and getattr(_as_built, "on", False):
        for block in blocks:  # as fully_shard on meta: the script gives the values
            shard_block(block)
        _meta.note_waiting(module)
    elif meta:
        with _meta.rank0_random_stream(job):
            _meta.materialise(module, blocks, job.device, shard_block)
    else:
        for block in blocks:
            broadcast_from_rank0(job, block)
            shard_block(block)
        broadcast_from_rank0(job, module)  # the root's own parameters and buffers
    fully_shard(module, **options)


def shard_options(job: Job, plan: ShardingPlan) -> dict[str, Any]:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    dtype = compute_dtype()
    if plan.cpu_offload and job.device.type == "cpu":
        raise ConfigurationError(
            "sharded(cpu_offload=True) keeps parameters on the CPU between uses of an "
            "accelerator; this job's device is already the CPU. Drop cpu_offload, or run on GPUs.")
    return {
        "mesh": job.sharding_mesh(job.copy_size(plan.shard_size, plan.hybrid)),
        "reshard_after_forward": plan.reshard_after_forward,
        # compute in the scope's dtype; reduce gradients and keep master weights in fp32
        "mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        if dtype is not None else MixedPrecisionPolicy(),
        "offload_policy": CPUOffloadPolicy() if plan.cpu_offload else OffloadPolicy(),
    }


def compute_dtype() -> torch.dtype | None:
    """The compute dtype of the open precision concern (fixed for the model at sharding)."""
    stack = _state.current()
    dtypes = (c.compute_dtype() for c in (stack.concerns if stack is not None else ()))
    return next((dtype for dtype in dtypes if dtype is not None), None)


def find_blocks(module: nn.Module, spec: BlockSpec) -> list[nn.Module]:
    """The submodules sharded on their own, innermost first (fully_shard's order)."""
    if spec is None:
        found: list[nn.Module] = []
        _find_repeated(module, found)
        return found
    if isinstance(spec, tuple):
        classes = spec
        matches = [m for m in module.modules() if m is not module and isinstance(m, classes)]
    else:
        matches = [m for m in module.modules() if m is not module and spec(m)]
    return list(reversed(matches))  # descendants before their ancestors


def _check_blocks(module: nn.Module, spec: BlockSpec) -> None:
    """Blocks asked for that the model does not have: refused before anything is sharded, in
    one process too (otherwise only the root would be sharded, every parameter gathered at
    each forward, without a word), naming the classes the model has that could be blocks."""
    if spec is None or find_blocks(module, spec) or not any(True for _ in module.parameters()):
        return
    repeated: list[nn.Module] = []
    _find_repeated(module, repeated)  # the best candidates: listed first
    counts: dict[type[nn.Module], int] = {}
    for sub in module.modules():
        if sub is not module and not isinstance(sub, _CONTAINERS) and any(
                True for _ in sub.parameters()):
            counts[type(sub)] = counts.get(type(sub), 0) + 1
    kinds = sorted(counts, key=lambda c: not any(type(m) is c for m in repeated))
    found = ", ".join(f"{c.__name__} (x{counts[c]})" for c in kinds[:8]) or "none"
    if isinstance(spec, tuple):
        asked = f"[{', '.join(c.__name__ for c in spec)}]"
        names = " or ".join(c.__name__ for c in spec)
        why = f"no submodule of this {type(module).__name__} is a {names}"
    else:
        asked = getattr(spec, "__qualname__", repr(spec))
        why = f"the function matches no submodule of this {type(module).__name__}"
    example = kinds[0] if kinds else None
    raise ConfigurationError(
        f"sharded(blocks={asked}): {why}, so only the whole model would be sharded (every "
        f"parameter gathered at once in each forward). Classes in the model that could be "
        f"blocks: {found}. Name some of them"
        + (f" (sharded(blocks=[{example.__name__}]))" if example is not None else "")
        + ", or leave blocks=None to find the repeated layers.")


def _find_repeated(module: nn.Module, found: list[nn.Module]) -> None:
    """Children of a ModuleList/Sequential that are all of one class (transformer layers)."""
    for child in module.children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)):
            parts = list(child.children())
            kinds = {type(p) for p in parts}
            if len(parts) > 1 and len(kinds) == 1 and all(
                    any(True for _ in p.parameters()) for p in parts):
                found.extend(parts)
                continue
        _find_repeated(child, found)
    if not found and isinstance(module, (nn.ModuleList, nn.Sequential)):
        parts = list(module.children())
        if len(parts) > 1 and len({type(p) for p in parts}) == 1:
            found.extend(p for p in parts if any(True for _ in p.parameters()))


def broadcast_from_rank0(job: Job, module: nn.Module) -> None:
    """Rank 0's values of the parameters and buffers ``module`` holds that are not sharded
    yet, moved to the job's device first (blocks one at a time: the full model never is)."""
    from torch.distributed.tensor import DTensor

    device = job.device
    tensors: list[torch.Tensor] = []
    for sub in module.modules():
        for key, value in chain(sub._parameters.items(), sub._buffers.items()):
            if value is None or isinstance(value, DTensor):
                continue
            if device.type != "cpu" and value.device != device:
                moved = value.to(device)
                if key in sub._parameters:
                    value.data = moved  # the same Parameter object: ties and optimizers hold
                else:
                    sub._buffers[key] = value = moved
            tensors.append(value)
    unique = list({id(t): t for t in tensors}.values())
    if unique:
        from torch.distributed.utils import _sync_params_and_buffers

        group = dist.group.WORLD
        assert group is not None
        with torch.no_grad():
            _sync_params_and_buffers(group, [t.detach() for t in unique], 250 * 1024 * 1024, 0)
