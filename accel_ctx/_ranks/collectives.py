"""Collectives over nested structures of tensors: gather, reduce, broadcast, pad_across_processes.

Each reads the process group of the innermost ``distributed()`` scope when called. In a single
process (outside ``distributed()``, or a world of one) each returns its input itself, copying
nothing. Structures are tuples, lists, dicts, namedtuples and dataclasses (walked by ``_kernel.tree``),
rebuilt with their own types. Tensors travel where the backend takes them: CPU tensors through
gloo, CUDA tensors through NCCL; with an NCCL-only group, CPU tensors go through the job's
device and come back to the CPU. With several processes, gather and reduce return new tensors
without autograd history (broadcast too, except on ``src``, which gets its input back).

In debug mode (``distributed(debug=True)`` or ``ACCEL_CTX_DEBUG=1``) each collective first
checks, with the other ranks, that the calls fit together (see ``_group.debug``).
"""

from __future__ import annotations

import copy
import dataclasses
import numbers
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

import torch
import torch.distributed as dist

from .._group import debug as _debug
from .._group.blame import collective
from .._kernel import state as _state
from .._kernel.tree import iter_tensors, map_tensors
from .._options import checked, flag, whole
from ..errors import ConfigurationError
from .exchange import describe, exchange, of_call
from .reduce import reduce_tensors
from .skeleton import fill, merge, rebuild_mapping, rebuild_sequence

if TYPE_CHECKING:
    from .._job.job import Job

T = TypeVar("T")
ReduceOp = Literal["sum", "mean", "max", "min"]
_OPS = ("sum", "mean", "max", "min")
_ADVICE = (
    "Make every rank pass the same structure (same keys, same number of tensors) with tensors "
    "of one dtype and matching shapes: gather, gather_for_metrics: all dimensions but dim 0; "
    "pad_across_processes: all but `dim`; reduce: all. Use pad_across_processes() for uneven "
    "lengths, or a cast before the call."
)


def group_job() -> Job | None:
    """The innermost distributed() job when it has more than one process, else None."""
    job = _state.current_job()
    return job if job is not None and job.world_size > 1 else None


def meta_device(job: Job) -> torch.device:
    return job.comm_device(torch.device("cpu"))


def _pad_to(t: torch.Tensor, size: int, dim: int, value: Any, first: bool) -> torch.Tensor:
    missing = size - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    filler = torch.full(shape, value, dtype=t.dtype, device=t.device)
    return torch.cat((filler, t) if first else (t, filler), dim=dim)


def gather_tensor(
    job: Job, t: torch.Tensor, sizes: list[int], keep: list[bool] | None = None
) -> torch.Tensor:
    """Every rank's ``t`` concatenated along dim 0 (``sizes``: their dim 0; ``keep``: whose)."""
    scalar = t.dim() == 0
    x = t.detach().reshape(1) if scalar else t.detach()
    x = _pad_to(x.to(job.comm_device(t.device)), max(sizes), 0, 0, False).contiguous()
    parts = [torch.empty_like(x) for _ in range(job.world_size)]
    dist.all_gather(parts, x)
    kept = [p[:n] for r, (p, n) in enumerate(zip(parts, sizes, strict=True))
            if keep is None or keep[r]]
    return (torch.cat(kept) if kept else x[:0]).to(t.device)


def travel_type(job: Job) -> Callable[[torch.Tensor], str]:
    """The device type each tensor travels on (part of what the ranks must agree on)."""
    return lambda t: job.comm_device(t.device).type


@collective
@checked
def gather(tensors: T) -> T:
    """Concatenate every rank's tensors along dim 0, in rank order; the same result on all ranks.

    ``tensors`` is a tensor or a nested structure of them (tuples, lists, dicts, namedtuples,
    dataclasses). First dimensions may differ between ranks (they are padded for the transfer
    and trimmed after); everything else must agree on every rank: the structure (keys, lengths),
    each tensor's dtype, number of dimensions and other sizes. A 0-dim tensor becomes one row
    per rank. Plain Python data is gathered too: a list or tuple holding no tensor (``[1, 2,
    3]``, a batch of strings or per-sample dicts) is a batch of objects, concatenated in rank
    order like a tensor's rows; any other value (a number, a string) becomes the list of every
    rank's value, as a 0-dim tensor becomes one row per rank; None stays None. The rule is the
    same for every number of processes: in one process a tensor with rows and a batch come
    back as they are, a 0-dim tensor as one row and a bare value as a list of one.

    Under tensor parallelism (``tp=``) the ranks of one tensor-parallel group evaluate the same
    batch, so each data-parallel group's rows come once, from its tp rank 0: per-sample results
    gathered (or counts summed with :func:`reduce`) count each sample once, as
    :func:`gather_for_metrics` does. :func:`gather_object` stays one entry per rank.

    When the ranks' inputs do not fit together, every rank raises :class:`DistributedError`
    naming each rank's shapes, before any data moves: the check rides in the exchange of first
    dimensions that gather makes anyway (one small all_gather, then one per tensor; Python data
    adds one object exchange).

    Examples:
        >>> import torch
        >>> from accel_ctx import gather
        >>> out = gather({"pred": torch.tensor([1, 2]), "loss": torch.tensor(0.5)})
        >>> out["pred"].tolist(), out["loss"].tolist()  # one process: one rank's rows
        ([1, 2], [0.5])
        >>> gather(5)  # a bare value: one entry per rank, on any number of ranks
        [5]
    """
    job = group_job()
    if job is None:
        return _one_rank(tensors)  # type: ignore[no-any-return]
    d = describe(tensors, "gather()", free_dim=0, batches=True, travel=travel_type(job))
    _debug.check(job, "gather()", d.tensors, free_dim=0)
    heads = exchange(job, d, "gather()", 0, meta_device(job), _ADVICE)
    # the tp (or sp) ranks of one data-parallel group hold the same batch: the first speaks
    tp = job.coordinates.sharers
    keep = [r % tp == 0 for r in range(job.world_size)] if tp > 1 else None
    gathered = [gather_tensor(job, t, [r[i] for r in heads.free], keep)
                for i, t in enumerate(d.tensors)]
    if heads.skeletons is None:
        done = iter(gathered)
        return map_tensors(tensors, lambda _: next(done))  # type: ignore[no-any-return]
    skeletons = heads.skeletons if keep is None else heads.skeletons[::tp]
    return merge(skeletons, gathered)  # type: ignore[no-any-return]


def _one_rank(obj: Any) -> Any:
    """What :func:`gather` gives when the job is one rank (the rule of :func:`merge`): the
    input itself where nothing changes."""
    if isinstance(obj, torch.Tensor):
        return obj.reshape(1) if obj.dim() == 0 else obj
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        values = {k: _one_rank(v) for k, v in obj.items()}
        same = all(values[k] is v for k, v in obj.items())
        return obj if same else rebuild_mapping(obj, values)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: _one_rank(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        if all(v is getattr(obj, k) for k, v in fields.items()):
            return obj
        new = copy.copy(cast(Any, obj))
        for name, value in fields.items():
            object.__setattr__(new, name, value)
        return new
    if isinstance(obj, (list, tuple)):
        if next(iter_tensors(obj), None) is None:
            return obj  # a batch of objects: one rank's rows
        items = [_one_rank(v) for v in obj]  # a structure: position by position
        if all(a is b for a, b in zip(items, obj, strict=True)):
            return obj
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*items)
        return items if type(obj) is list else rebuild_sequence(obj, items)
    return [obj]  # a bare value: one per rank


@collective
@checked
def gather_object(obj: T) -> list[T]:
    """Every rank's ``obj`` (any picklable object), in rank order; ``[obj]`` in a single process.

    Objects are pickled; for tensors prefer :func:`gather`, which moves them without copying
    through Python. Like every collective here it starts with the header that checks the
    ranks' calls, so a rank in another collective (``gather`` on one rank, ``gather_object`` on
    another) raises :class:`DistributedError` on every rank instead of aborting the process.

    Examples:
        >>> from accel_ctx import gather_object
        >>> gather_object({"rank": 0, "files": ["a.txt"]})
        [{'rank': 0, 'files': ['a.txt']}]
    """
    job = group_job()
    if job is None:
        return [obj]
    _debug.check(job, "gather_object()")
    d = of_call("gather_object()")
    d.data, d.skeleton = True, obj  # the skeletons exchange carries the objects themselves
    return exchange(job, d, "gather_object()", 0, meta_device(job), _ADVICE).skeletons or []


@collective
@checked
def reduce(tensors: T, op: ReduceOp = "sum") -> T:
    """Combine every rank's tensors element-wise: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``.

    ``tensors`` is a tensor, a Python number, or a nested structure of them, of the same
    structure, shapes and dtypes on every rank; every rank gets the result as new tensors (the
    inputs are left untouched; Python numbers come back as numbers of their type, a mean as a
    float). The mean of integer tensors is a floating-point tensor. In a single process the
    input itself is returned. Under tensor parallelism (``tp=``) the ranks of one
    tensor-parallel group work on the same batch, so each data-parallel group is counted once
    (its tp rank 0's values; a mean divides by ``dp_size``): per-sample counts summed after an
    evaluation count each sample once.

    When the ranks' inputs do not fit together, every rank raises :class:`DistributedError`
    naming each rank's shapes and none gets a value: the check travels in the header every
    collective starts with, and a small reduction's data with it (see ``_ranks.reduce``), so a
    matching call of up to 59 values costs one small all_gather. Sums of floats are computed
    exactly and rounded once to each tensor's dtype (larger ones: torch's all_reduce).

    Examples:
        >>> import torch
        >>> from accel_ctx import reduce
        >>> reduce({"loss": torch.tensor(2.0)}, "mean")
        {'loss': tensor(2.)}
    """
    if op not in _OPS:
        raise ConfigurationError(f"reduce(op={op!r}): give one of 'sum', 'mean', 'max', 'min'.")
    job = group_job()
    if job is None:
        return tensors
    call = f"reduce(op={op!r})"
    d = describe(tensors, call, free_dim=None, batches=False, numbers=True,
                 travel=travel_type(job))
    _debug.check(job, call, d.tensors)
    results = reduce_tensors(job, d, op, meta_device(job), _ADVICE)
    if d.values:  # the same on every rank: the signatures matched
        raise ConfigurationError(
            f"{call} found values it cannot combine at {', '.join(d.values)}; it reduces "
            "tensors and Python numbers (in tuples, lists, dicts, namedtuples, dataclasses). "
            "Use gather_object() for other objects, or convert them with torch.as_tensor()."
        )
    values = [r if kind == "tensor" else r.item() for r, kind in zip(results, d.kinds,
                                                                       strict=True)]
    return fill(d.skeleton, values)  # type: ignore[no-any-return]


@collective
@checked
def pad_across_processes(tensors: T, dim: int = 0, pad_index: Any = 0,
                         pad_first: bool = False) -> T:
    """Pad each tensor along ``dim`` to the largest size any rank has, so collectives fit.

    Fills with ``pad_index`` at the end (``pad_first=True``: at the start, e.g. left-padded
    token ids). Tensors already of the largest size, or without dimension ``dim`` (a 0-dim
    loss), are returned as they are; other leaves (None, numbers, strings) too. Only the size
    along ``dim`` changes; other sizes may differ between ranks (as Accelerate's: a last
    batch of 1 sequence on one rank and of 3 on another, padded along ``dim=1``). The
    structure, each tensor's dtype and number of dimensions must agree across ranks:
    otherwise every rank raises :class:`DistributedError` naming each rank's shapes, found in
    the one small all_gather of sizes the call makes anyway. In a single process the input
    itself is returned.

    Examples:
        >>> import torch
        >>> from accel_ctx import pad_across_processes
        >>> pad_across_processes(torch.tensor([[1, 2]]), dim=1).tolist()
        [[1, 2]]
    """
    whole("pad_across_processes", "dim", dim, -(2**31), "give the dimension to pad, an int.")
    flag("pad_across_processes", "pad_first", pad_first)
    if not isinstance(pad_index, numbers.Number):  # a bool pads a mask
        raise ConfigurationError(
            f"pad_across_processes(pad_index={pad_index!r}): give the number to pad with (e.g. "
            "0, or the tokenizer's pad token id).")
    job = group_job()
    if job is None:
        return tensors
    call = f"pad_across_processes(dim={dim})"
    d = describe(tensors, call, free_dim=dim, batches=False, travel=travel_type(job),
                 sizes_free=True)
    _debug.check(job, call, d.tensors, compare_shapes=False)
    lengths = exchange(job, d, call, 0, meta_device(job), _ADVICE).free
    padded = iter([
        t if lengths[job.rank][i] < 0
        else _pad_to(t, max(r[i] for r in lengths), dim, pad_index, pad_first)
        for i, t in enumerate(d.tensors)
    ])
    return map_tensors(tensors, lambda _: next(padded))  # type: ignore[no-any-return]
