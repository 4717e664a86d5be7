"""Evaluation and inference across ranks: gather_for_metrics and split_between_processes."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from . import _debug, _state
from ._collectives import gather_tensor, group_runtime
from ._tree import iter_tensors, map_tensors
from .errors import ConfigurationError

T = TypeVar("T")


class _Rows:
    """Stands for the tensor number ``index`` of one rank's input, with its first dimension."""

    __slots__ = ("index", "rows")

    def __init__(self, index: int, rows: int) -> None:
        self.index = index
        self.rows = rows


def gather_for_metrics(obj: T) -> T:
    """Gather one evaluation batch from every rank, without the samples padding repeated.

    With ``even_batches`` (the default) the last round of an epoch is padded with whole batches
    from the epoch's start so every rank gets as many batches; those are dropped here, so over
    an epoch a metric sees each sample exactly once, in dataset order (the ranks' batches are
    concatenated in rank order, which is the order of the epoch's batches). Call it once per
    batch, inside the loop over the DataLoader (it reads which batch this rank got last). With
    ``distributed(even_batches=False)`` nothing is padded: in an incomplete last round the ranks
    without a batch take part in its calls with nothing (torch's Join, see ``_join``), so make
    the same calls for every batch.

    ``obj`` is a tensor, a list of per-sample objects (strings, ids, dicts), or a nested
    structure of those (tuples, dicts, namedtuples, dataclasses): tensors are concatenated
    along dim 0 (first dimensions may differ), lists of objects are concatenated, None stays
    None. In a single process the input itself is returned.

    Example:
        >>> import torch
        >>> from torch.utils.data import DataLoader
        >>> from accel_ctx import distributed, gather_for_metrics
        >>> predictions, names = [], []
        >>> with distributed():
        ...     for x in DataLoader(torch.arange(10.0), batch_size=4):
        ...         p, n = gather_for_metrics((x * 2, [f"s{int(i)}" for i in x]))
        ...         predictions.append(p)
        ...         names += n
        >>> len(torch.cat(predictions)), names[:3]
        (10, ['s0', 's1', 's2'])
    """
    stack = _state.current()
    runtime = group_runtime()
    if runtime is None or stack is None:
        return obj
    iteration = stack.session.active_loader()
    padding = iteration is not None and iteration.is_padding
    if iteration is not None and iteration.uneven is not None:
        iteration.uneven.note_gather(obj, iteration.index)  # even_batches=False: see _join
    return _gather(runtime, obj, padding)


def _gather(runtime: Any, obj: T, padding: bool) -> T:
    """One rank's part of a gather_for_metrics call (``padding``: contribute nothing)."""
    tensors = list(iter_tensors(obj))
    _debug.check(runtime, "gather_for_metrics()", tensors, free_dim=0)
    numbered = iter(range(len(tensors)))
    skeleton = map_tensors(obj, lambda t: _Rows(next(numbered), t.shape[0] if t.dim() else 1))
    # One object exchange carries each rank's padding flag, its lists of objects and its
    # tensors' sizes; the tensors themselves then travel as tensors.
    parts: list[Any] = [None] * runtime.world_size
    dist.all_gather_object(parts, (padding, skeleton))
    keep = [not flag for flag, _ in parts]
    rows = [_rows_of(s) for _, s in parts]
    gathered = [
        gather_tensor(runtime, t, [r[i] for r in rows], keep) for i, t in enumerate(tensors)
    ]
    return _merge([s for flag, s in parts if not flag], gathered)  # type: ignore[no-any-return]


def _rows_of(skeleton: Any) -> list[int]:
    found: dict[int, int] = {}

    def note(o: Any) -> Any:
        if isinstance(o, _Rows):
            found[o.index] = o.rows
        return o

    map_tensors(skeleton, lambda t: t, note)
    return [found[i] for i in range(len(found))]


def _holds_tensors(obj: Any) -> bool:
    found: list[bool] = []
    map_tensors(obj, lambda t: t, lambda o: found.append(True) if isinstance(o, _Rows) else o)
    return bool(found)


def _merge(parts: list[Any], gathered: list[torch.Tensor]) -> Any:
    """Combine the kept ranks' skeletons: tensors from ``gathered``, lists concatenated.

    ``_tree`` maps one structure; this zips several, following the same container kinds.
    """
    first = parts[0]
    if isinstance(first, _Rows):
        return gathered[first.index]
    if first is None:
        return None
    if isinstance(first, Mapping):
        merged = {k: _merge([p[k] for p in parts], gathered) for k in first}
        if type(first) is dict:
            return merged
        try:
            new = copy.copy(first)
            new.update(merged)  # type: ignore[attr-defined]
            return new
        except (TypeError, AttributeError):
            return merged
    if isinstance(first, tuple) and hasattr(first, "_fields"):  # namedtuple
        return type(first)(*(_merge(list(col), gathered) for col in zip(*parts, strict=True)))
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        new = copy.copy(cast(Any, first))
        for f in dataclasses.fields(first):
            value = _merge([getattr(p, f.name) for p in parts], gathered)
            object.__setattr__(new, f.name, value)
        return new
    if isinstance(first, (list, tuple)):
        if _holds_tensors(first):  # a structure holding tensors: merge position by position
            return type(first)(_merge(list(col), gathered) for col in zip(*parts, strict=True))
        return type(first)(item for p in parts for item in p)  # a batch of per-sample objects
    raise ConfigurationError(
        f"gather_for_metrics() found a bare {type(first).__name__} ({first!r}); it gathers "
        "tensors and lists of per-sample objects. Put per-sample values in a list or a tensor "
        "(one entry per sample), or use gather_object() for one value per rank."
    )


def split_between_processes(items: T, *, pad: bool = False) -> T:
    """This rank's contiguous part of ``items``: a list, tuple, tensor (dim 0) or dict of them.

    With ``k = ceil(len(items) / world_size)``, rank ``r`` gets items ``r*k`` to ``(r+1)*k``; the
    last ranks may get fewer, or none. ``pad=True`` gives every rank exactly ``k`` items, the
    short parts filled with copies of the last item, so that ``gather(results)[:len(items)]``
    is in the order of ``items``. A dict splits each of its values (all of the same length). In
    a single process ``items`` itself is returned.

    Example:
        >>> from accel_ctx import split_between_processes
        >>> split_between_processes(["a cat", "a dog", "a bird"])  # one process: everything
        ['a cat', 'a dog', 'a bird']
    """
    world, rank = _world_rank()
    if world == 1:
        return items
    if isinstance(items, Mapping):
        lengths = {k: _length(v, k) for k, v in items.items()}
        if len(set(lengths.values())) > 1:
            raise ConfigurationError(
                f"split_between_processes() got a dict whose values differ in length "
                f"{lengths}; give values of one length (one entry per item)."
            )
        parts = {k: _split(v, world, rank, pad) for k, v in items.items()}
        if type(items) is dict:
            return parts  # type: ignore[return-value]
        new = copy.copy(items)
        new.update(parts)  # type: ignore[attr-defined]
        return new
    _length(items, None)
    return _split(items, world, rank, pad)  # type: ignore[no-any-return]


def _world_rank() -> tuple[int, int]:
    stack = _state.current()
    runtime = stack.dist if stack is not None else None
    return (runtime.world_size, runtime.rank) if runtime is not None else (1, 0)


def _length(value: Any, key: Any) -> int:
    if isinstance(value, (list, tuple, torch.Tensor)) and not (
        isinstance(value, torch.Tensor) and value.dim() == 0
    ):
        return len(value)
    where = f" at key {key!r}" if key is not None else ""
    raise ConfigurationError(
        f"split_between_processes() cannot split a {type(value).__name__}{where}; give a list, "
        "tuple, tensor (split along dim 0) or a dict of them (convert iterators with list())."
    )


def _split(value: Any, world: int, rank: int, pad: bool) -> Any:
    n = len(value)
    k = math.ceil(n / world)
    part = value[min(rank * k, n):min((rank + 1) * k, n)]
    missing = k - len(part) if pad and n else 0
    if missing == 0:
        return part
    if isinstance(value, torch.Tensor):
        return torch.cat([part, value[-1:].expand(missing, *value.shape[1:])])
    return part + type(value)([value[-1]] * missing)
