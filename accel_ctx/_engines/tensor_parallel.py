"""The tensor-parallel engine: what a top-level call of a model runs under ``tp=N``.

A model's first top-level call outside rank-only code adopts it and, in torchtitan's order:
every rank takes rank 0's weights (a broadcast, as DDP's engine does); torch's
``parallelize_module`` splits the planned layers over the "tp" dimension of the job's
``("dp", "tp")`` mesh (``Job.tp_mesh``: groups of consecutive ranks); under ``sharded()``,
``fully_shard`` then shards every parameter over the "dp" dimension (blocks, then the root), or
with ``shard_size``/``hybrid`` (HSDP) over the "replicate" and "shard" dimensions of a
``("replicate", "shard", "tp")`` mesh.
The replaced parameters are recorded in the job's ``Adoption``, so every optimizer follows them.

The plan is the scope's ``tp_plan`` or the one the model declares (transformers'
``config.base_model_tp_plan`` and ``_tp_plan``); none is guessed. It is checked before anything
is split: every pattern names a module, each split dimension and each head count the modules on
the way declare divides by ``tp``. A parameter tied to a module the plan leaves alone (tied
embeddings) keeps its module replicated, so the tie holds.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn
from typing_extensions import override

from .._job.job import Job
from .._job.tp_plan import EXAMPLE, SPLITS, TensorPlan, matches
from .._kernel import state as _state
from .._kernel.session import Session
from .._warn import warn_user
from ..errors import ConfigurationError
from . import adopt as _adopt
from . import fsdp as _fsdp
from .fsdp_dtypes import settle_dtypes
from .tp_heads import HEAD_COUNTS, watch_first_forward


class TensorEngine(_fsdp.ShardedEngine):
    """A tensor-parallel model's engine: the sync switch is FSDP2's when the model is also
    sharded over "dp", else there is no gradient reduction to hold back (each TP group computes
    its gradients whole, and the job has one data-parallel rank)."""

    def __init__(self, module: nn.Module, sharded: bool) -> None:
        super().__init__(module)
        self.sharded = sharded

    @override
    def switch_sync(self, value: bool) -> None:
        if self.sharded:
            super().switch_sync(value)


def prepare(job: Job, module: nn.Module, grad: bool, session: Session, *, tensor: TensorPlan,
            sharding: _fsdp.ShardingPlan | None) -> tuple[nn.Module, _fsdp.ShardedEngine | None]:
    """What to call for a top-level call of ``module``, and its engine (or None)."""
    record = _adopt.root_record(job, module)
    if record is None:
        return module, None  # the user's own engine, or a part (its own hooks redistribute)
    if record.engine is None:
        if _state.rank_only() is not None and job.world_size > 1:
            return module, None  # splitting is collective: wait for every rank
        record.engine = parallelize(job, module, tensor, sharding, session) or False
    engine = record.engine
    if isinstance(engine, nn.parallel.DistributedDataParallel):
        raise ConfigurationError(
            f"this {type(module).__name__} already trains with DDP in this job: its first call "
            f"with gradients ran under distributed() without tp=. Open the tp={tensor.size} "
            "scope before the model's first call.")
    if not isinstance(engine, _fsdp.ShardedEngine):
        return module, None
    _fsdp.check_call(job, module, grad)
    return module, engine


def parallelize(job: Job, module: nn.Module, tensor: TensorPlan,
                sharding: _fsdp.ShardingPlan | None, session: Session) -> TensorEngine | None:
    """Split ``module`` over "tp" (and shard it over "dp" under ``sharded()``); point the known
    optimizers at its new parameters. None: nothing to split (no parameters, one process)."""
    if not any(True for _ in module.parameters()) or not dist.is_initialized():
        return None
    if any(t.is_meta for t in module.parameters()):
        raise ConfigurationError(
            f"tp={tensor.size}: this {type(module).__name__} was built on the meta device, which "
            "tensor parallelism does not take yet. Build it on the CPU (the default device).")
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    # torch.compile(model)'s wrapper: the plan names the user's model's modules
    model = module._modules.get("_orig_mod") or module
    styles = resolve(model, tensor)
    sharded = shards_over_dp(job, sharding)
    # HSDP: the split and the sharding on one 3-D mesh ("replicate", "shard", "tp")
    mesh = job.tp_mesh_for(
        job.copy_size(sharding.shard_size, sharding.hybrid) if sharding is not None else None)
    before = dict(module.named_parameters())
    _adopt.move_to_device(job, module)
    _fsdp.broadcast_from_rank0(job, module)  # every rank starts from rank 0's weights
    parallelize_module(model, mesh["tp"], styles)
    if model is module:  # not under torch.compile's wrapper: the watch would be traced
        watch_first_forward(model, styles, tensor.size)  # heads viewed by the whole count
    if sharded:
        assert sharding is not None
        blocks = _fsdp.find_blocks(module, sharding.blocks)
        settle_dtypes(module, blocks, _fsdp.compute_dtype(), job.rank == 0)
        options = _fsdp.shard_options(job, sharding)
        for block in blocks:
            fully_shard(block, **options)
        fully_shard(module, **options)
    _adopt.record_replaced(job, before, module)
    for optimizer in list(session.optimizers.keys()):
        _adopt.adopt_optimizer(job, optimizer)  # met before: point them at the new parameters
    return TensorEngine(module, sharded)


def shards_over_dp(job: Job, sharding: _fsdp.ShardingPlan | None) -> bool:
    """Whether FSDP2 takes the split model over "dp" (every parameter then a DTensor)."""
    return sharding is not None and job.coordinates.dp_size > 1


def replicate_plain_tensors(on: bool) -> None:
    """Treat plain tensors as replicated over "tp" in DTensor ops (``on``) or refuse them again.

    Without FSDP2 over "dp", the parameters the plan leaves alone stay plain tensors beside the
    split DTensors. A foreach or fused optimizer step (CUDA's default) updates them in one list,
    which DTensor refuses ("got mixed torch.Tensor and DTensor"); torch's answer is
    ``implicit_replication()`` around the step. It is true of these tensors: every rank of a TP
    group holds the same values and computes the same gradients for them.
    """
    from torch.distributed.tensor import DTensor

    DTensor._op_dispatcher._allow_implicit_replication = on


def explain_failure(module: nn.Module, tensor: TensorPlan, exc: Exception) -> None:
    """A split model's forward that failed reshaping: the usual cause is a view by the model's
    whole head count, where each rank holds ``1/tp`` of a colwise layer's heads."""
    if isinstance(exc, RuntimeError) and "is invalid for input of size" in str(exc):
        raise ConfigurationError(
            f"tp={tensor.size}: the forward of this {type(module).__name__} failed reshaping "
            f"({exc}), most likely a split layer's output viewed by the model's whole head "
            f"count: each rank holds 1/{tensor.size} of the heads of a 'colwise' layer. "
            "Reshape by the local count, view(b, t, -1, head_dim), not view(b, t, n_heads, "
            "head_dim) (view(b, t, n_heads, -1), which would split the heads wrongly without "
            "an error, is refused at the first forward).") from exc


# ---- the plan ------------------------------------------------------------------------------------
def resolve(module: nn.Module, tensor: TensorPlan) -> dict[str, Any]:
    """The plan for ``module``: module name -> torch ParallelStyle, checked."""
    from .tp_styles import layout  # loads torch.distributed.tensor: only once a plan is used

    declared = tensor.styles if tensor.styles is not None else declared_plan(module)
    kind = type(module).__name__
    if declared is None:
        raise ConfigurationError(
            f"tp={tensor.size}: this {kind} declares no tensor-parallel plan, and none was "
            "given. Say which layers split how (a guessed plan could split attention heads "
            f"wrongly without a word), e.g. sharded(tp={tensor.size}, {EXAMPLE}): 'colwise' "
            "for the layers whose outputs are per head (q, k, v, MLP up), 'rowwise' for the "
            "ones that bring them back (attention output, MLP down).")
    names = [name for name, _ in module.named_modules() if name]
    chosen: dict[str, Any] = {}
    for pattern, style in declared:
        found = [name for name in names if matches(pattern, name)]
        if not found and tensor.styles is None:
            continue  # a model's own plan names every variant's modules (transformers skips too)
        if not found:
            near = [n for n in names if n.split(".")[-1] == pattern.split(".")[-1]][:3] or [
                n for n in names if not n.split(".")[-1].isdigit()][:6]
            raise ConfigurationError(
                f"tp_plan: {pattern!r} names no module of this {kind} ('*' stands for one "
                f"path segment). Modules it has: {', '.join(near) or 'none'}. Write the paths "
                "as model.named_modules() names them.")
        for name in found:
            chosen[name] = style
    if not chosen and tensor.styles is None:
        raise ConfigurationError(
            f"tp={tensor.size}: the tensor-parallel plan this {kind} declares names none of its "
            f"modules ({', '.join(p for p, _ in declared[:3])}, ...), so nothing would be split. "
            f"Give the plan yourself: sharded(tp={tensor.size}, {EXAMPLE}).")
    chosen = {name: style for name, style in chosen.items() if style != "replicate"}
    _leave_tied(module, chosen, given=tensor.styles is not None)
    _check_divisible(module, chosen, tensor.size)
    return layout(module, chosen, tensor.size, tensor.loss_parallel)


def declared_plan(module: nn.Module) -> tuple[tuple[str, Any], ...] | None:
    """The plan a transformers model declares: its config's ``base_model_tp_plan`` (paths in
    the base model, under ``base_model_prefix``) and its own ``_tp_plan``; None without one."""
    plan: dict[str, Any] = {}
    base = getattr(getattr(module, "config", None), "base_model_tp_plan", None)
    if isinstance(base, dict) and base:
        prefix = getattr(module, "base_model_prefix", "")
        inside = isinstance(prefix, str) and prefix and isinstance(
            getattr(module, prefix, None), nn.Module)
        plan.update({f"{prefix}.{key}" if inside else key: style for key, style in base.items()})
    own = getattr(module, "_tp_plan", None)
    if isinstance(own, dict):
        plan.update(own)
    return tuple(plan.items()) or None


def _leave_tied(module: nn.Module, chosen: dict[str, Any], given: bool) -> None:
    """Drop the planned modules whose parameters another module shares (tied embeddings):
    splitting one side would untie them. They stay replicated over "tp"."""
    owners: dict[int, list[str]] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        for param in sub._parameters.values():
            if param is not None:
                owners.setdefault(id(param), []).append(name)
    for name in list(chosen):
        sub = module.get_submodule(name)
        tied = [other for p in sub._parameters.values() if p is not None
                for other in owners[id(p)] if other != name]
        if tied:
            del chosen[name]
            if _state.coordinates().rank == 0:
                fix = ("leave it out of the plan to silence this" if given else "the model's "
                       "own plan names it; give tp_plan= without it to silence this")
                warn_user(f"tp_plan: {name} shares its weight with {tied[0]} (tied), so it stays "
                          f"whole on every rank rather than split; {fix}.", RuntimeWarning)


def _check_divisible(module: nn.Module, chosen: dict[str, Any], tp: int) -> None:
    """Each split dimension and each declared head count divides by ``tp``, before any split."""
    problems: list[str] = []
    for name, style in chosen.items():
        sub = module.get_submodule(name)
        if isinstance(style, str) and style in SPLITS:
            dims = {nn.Linear: ("out_features", "in_features"),
                    nn.Embedding: ("embedding_dim", "num_embeddings")}
            pair = next((d for cls, d in dims.items() if isinstance(sub, cls)), None)
            if pair is None:
                raise ConfigurationError(
                    f"tp_plan: {name} is a {type(sub).__name__}; '{style}' splits an nn.Linear "
                    "or nn.Embedding. Name the Linear layers inside it, or give a torch "
                    "ParallelStyle that handles this module.")
            attr = pair[0] if SPLITS[style] == "out" else pair[1]
            size = getattr(sub, attr)
            if size % tp:
                problems.append(f"{name}.{attr} = {size}")
        path = name.split(".")
        for depth in range(len(path)):
            owner = module.get_submodule(".".join(path[:depth]))
            for attr in HEAD_COUNTS:
                count = getattr(owner, attr, None)
                where = ".".join([*path[:depth], attr]) or attr
                if isinstance(count, int) and not isinstance(count, bool) and count % tp:
                    problems.append(f"{where} = {count}")
    config = getattr(module, "config", None)
    for attr in ("num_attention_heads", "num_key_value_heads"):
        count = getattr(config, attr, None)
        if isinstance(count, int) and count % tp:
            problems.append(f"config.{attr} = {count}")
    if problems:
        unique = list(dict.fromkeys(problems))
        raise ConfigurationError(
            f"tp={tp}: {', '.join(unique[:4])} cannot be split over {tp} ranks (each rank must "
            f"hold whole heads and equal parts). Pick a tp that divides "
            f"{' and '.join(u.rsplit(' = ', 1)[1] for u in unique[:2])}, or leave those "
            "modules out of tp_plan.")
