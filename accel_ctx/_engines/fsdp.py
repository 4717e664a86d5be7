"""The FSDP2 engine: what a top-level call of an adopted module runs under ``sharded()``.

A model's first top-level call outside rank-only code adopts it (``_engines.adopt``, without the move:
the engine moves it piece by piece) and shards it with torch's ``fully_shard``: each block
first (the repeated children of a ``ModuleList``/``Sequential``, or the ones the plan names),
then the root. Every rank starts from rank 0's weights, broadcast block by block before each is
sharded, as DDP does for the whole model. A model built on ``meta`` is materialised module by
module in module order, each initialised by its ``reset_parameters()`` from rank 0's random
stream (every rank draws the same numbers, so the shards form one model, and rank 0 draws what
one process would), and each block is sharded as soon as it is complete: no rank ever holds
more than the root's own parameters and one block in full.

``fully_shard`` replaces the parameters with sharded ones; the old ones are recorded in the
job's :class:`~accel_ctx._job.job.Adoption` so that every optimizer, made before or after, is
pointed at the new ones (``_engines.adopt.adopt_optimizer``), its existing state sharded alike.
"""

from __future__ import annotations

import contextlib
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
from . import records as _records
from .fsdp_dtypes import settle_dtypes
from .join import refuse_forward

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
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
    record = _records.module_record(module)
    if record is None or record.owner is not job.root:
        if isinstance(module, nn.parallel.DistributedDataParallel) or _adopt.managed_elsewhere(
                module):
            return module, None  # the user's own engine: leave it to them
        record = _adopt.adopt(job, module, move=False)  # records only: nothing moves yet
    if not record.root:
        return module, None  # a part of a sharded model: its own block hooks gather it
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
    return module, engine


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
        _check_meta_init(module)
    _check_blocks(module, plan.blocks)
    before = dict(module.named_parameters())
    settle_dtypes(module, find_blocks(module, plan.blocks), compute_dtype(), job.rank == 0)
    stack = _state.current()
    for concern in stack.concerns if sharding and stack is not None else ():
        concern.before_sharding(module)  # fp8: its weights wrapped to gather in float8
    if sharding:
        _shard(job, module, plan, meta)
    elif meta:  # one process: nothing to shard, but the model must exist
        _materialise(module, [], job.device, lambda block: None)
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

    if meta:
        with _rank0_random_stream(job):
            _materialise(module, blocks, job.device, shard_block)
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


# ---- models built on meta ------------------------------------------------------------------------
def _check_meta_init(module: nn.Module) -> None:
    """Every meta tensor must belong to a module that can initialise it: fail before sharding."""
    for name, sub in module.named_modules():
        direct = [k for k, v in chain(sub._parameters.items(), sub._buffers.items())
                  if v is not None and v.is_meta]
        if direct and not callable(getattr(sub, "reset_parameters", None)):
            where = f"{name}." if name else ""
            raise ConfigurationError(
                f"the model was built on the meta device, but {type(sub).__name__} "
                f"({where}{direct[0]}) has no reset_parameters() to give its tensors values "
                "after sharding. Give the module a reset_parameters() that initialises them, "
                "or build that part on a real device (torch.device('cpu')).")


def _materialise(module: nn.Module, blocks: list[nn.Module], device: torch.device,
                 shard_block: Callable[[nn.Module], None]) -> None:
    """Give every meta tensor storage on ``device`` and values from its module's
    ``reset_parameters()``, in module order; shard each block once it is complete."""
    block_of: dict[int, nn.Module] = {}
    left: dict[int, int] = {}
    for block in blocks:
        for sub in block.modules():
            block_of.setdefault(id(sub), block)
        left[id(block)] = sum(1 for _ in block.modules())
    made: dict[int, torch.Tensor] = {}  # tied tensors get one storage, as in the model
    for sub in module.modules():
        touched = False
        stores: tuple[dict[str, Any], ...] = (sub._parameters, sub._buffers)
        for store in stores:
            for key, value in list(store.items()):
                if value is None or not value.is_meta:
                    continue
                new = made.get(id(value))
                if new is None:
                    empty = torch.empty_like(value, device=device)
                    new = (nn.Parameter(empty, requires_grad=value.requires_grad)
                           if isinstance(value, nn.Parameter) else empty)
                    made[id(value)] = new
                store[key] = new
                touched = True  # tied: reset again, as the module that owns it last would
        if touched:
            with torch.no_grad():
                sub.reset_parameters()  # type: ignore[operator]
        owner = block_of.get(id(sub))
        if owner is not None:
            left[id(owner)] -= 1
            if left[id(owner)] == 0:
                shard_block(owner)


@contextlib.contextmanager
def _rank0_random_stream(job: Job) -> Iterator[None]:
    """Every rank draws rank 0's random numbers; rank 0 draws from its own stream, as one
    process would, and the other ranks' streams are left as they were."""
    cuda = job.device.type == "cuda"
    states: list[Any] = [torch.get_rng_state(),
                         torch.cuda.get_rng_state(job.device) if cuda else None]
    dist.broadcast_object_list(states, src=0)
    if job.rank == 0:
        yield
        return
    with torch.random.fork_rng(devices=[job.device] if cuda else []):
        torch.set_rng_state(states[0])
        if cuda:
            torch.cuda.set_rng_state(states[1], job.device)
        yield
