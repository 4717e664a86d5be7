"""Evaluation and inference across ranks: gather_for_metrics and split_between_processes."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar, cast, overload

import torch
from torch.utils.data import Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

from .._group import debug as _debug
from .._group.blame import collective
from .._kernel import state as _state
from .._kernel.session import LoaderIteration
from .._kernel.tree import iter_tensors, map_tensors
from .._options import checked, flag
from ..errors import ConfigurationError
from .collectives import _ADVICE, gather_tensor, group_job, meta_device, travel_type
from .exchange import PADDING, describe, exchange
from .skeleton import merge, rebuild_mapping, rebuild_sequence

T = TypeVar("T")
Item = TypeVar("Item")


@collective
@checked
def gather_for_metrics(obj: T) -> T:
    """Gather one evaluation batch from every rank, without the samples padding repeated.

    With ``even_batches`` (the default) the last round of an epoch is padded with whole batches
    from the epoch's start so every rank gets as many batches; those are dropped here, so over
    an epoch a metric sees each sample exactly once, in dataset order (the ranks' batches are
    concatenated in rank order, which is the order of the epoch's batches). Call it once per
    batch, inside the loop over the DataLoader (it reads which batch this rank got last). With
    ``distributed(even_batches=False)`` nothing is padded: in an incomplete last round the ranks
    without a batch take part in its calls with nothing (torch's Join, see ``_engines.join``), so make
    the same calls for every batch.

    A loader the user sharded with their own ``DistributedSampler`` (accel_ctx leaves it as it
    is) repeats a few samples to give every rank as many; with ``drop_last=False`` (its
    default) the copy at the end of a rank's last batch is dropped here too, so the metric
    again sees ``len(dataset)`` samples, each once (in the sampler's interleaved order).

    ``obj`` is a tensor, a list of per-sample objects (strings, ids, dicts), or a nested
    structure of those (tuples, dicts, namedtuples, dataclasses): tensors are concatenated
    along dim 0 (first dimensions may differ), lists of objects are concatenated, None stays
    None. Structures that do not fit together across the ranks raise
    :class:`DistributedError` on every rank (see :func:`gather`). In a single process the
    input itself is returned.

    Examples:
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
    job = group_job()
    if job is None or stack is None:
        return obj
    job.root.metric_gathers += 1  # this evaluation's results meet the other ranks (_eval_passes)
    iteration = stack.session.active_loader()
    padding = iteration is not None and iteration.is_padding
    # The ranks of a tensor-parallel group evaluate the same batch: one of them speaks for it.
    padding = padding or job.coordinates.rank % job.coordinates.sharers != 0
    if iteration is not None and iteration.uneven is not None:
        iteration.uneven.note_gather(obj, iteration.index, _gather)  # even_batches=False: see _join
    if iteration is not None and _sampler_padded(iteration):
        obj = _drop_last_sample(obj)
    return _gather(job, obj, padding)


def _gather(job: Any, obj: T, padding: bool) -> T:
    """One rank's part of a gather_for_metrics call (``padding``: contribute nothing)."""
    call = "gather_for_metrics()"
    d = describe(obj, call, free_dim=0, batches=True, travel=travel_type(job))
    _debug.check(job, call, d.tensors, free_dim=0)
    heads = exchange(job, d, call, PADDING if padding else 0, meta_device(job), _ADVICE)
    if d.values:  # the same on every rank: the signatures matched
        raise ConfigurationError(
            f"gather_for_metrics() found a bare value at {', '.join(d.values)}; it gathers "
            "tensors and lists of per-sample objects. Put per-sample values in a list or a "
            "tensor (one entry per sample), or use gather() / gather_object() for one value "
            "per rank."
        )
    keep = [not flags & PADDING for flags in heads.flags]
    gathered = [gather_tensor(job, t, [r[i] for r in heads.free], keep)
                for i, t in enumerate(d.tensors)]
    if heads.skeletons is None:
        done = iter(gathered)
        return map_tensors(obj, lambda _: next(done))  # type: ignore[no-any-return]
    kept = [s for s, k in zip(heads.skeletons, keep, strict=True) if k]
    return merge(kept, gathered)  # type: ignore[no-any-return]


def _sampler_padded(iteration: LoaderIteration) -> bool:
    """This is the batch holding the sample a user's DistributedSampler repeated as padding.

    DistributedSampler (drop_last=False) pads its index list to a multiple of the number of
    replicas with the first indices again; the copies land at the end, as the last sample of
    the ranks ``r >= len(dataset) - (num_samples - 1) * num_replicas``.
    """
    loader = iteration.loader
    if loader is None or not iteration.is_last:
        return False
    batch_sampler = loader.batch_sampler
    sampler = loader.sampler
    if not isinstance(sampler, DistributedSampler):
        sampler = getattr(batch_sampler, "sampler", None)
    if not isinstance(sampler, DistributedSampler) or sampler.drop_last:
        return False
    n = len(sampler.dataset)  # type: ignore[arg-type]
    if (sampler.num_samples - 1) * sampler.num_replicas + sampler.rank < n:
        return False  # this rank's last sample is a real one
    # the loader may have dropped the incomplete last batch, padding sample included
    size = getattr(batch_sampler, "batch_size", None)
    dropped = getattr(batch_sampler, "drop_last", False)
    return not (dropped and size and sampler.num_samples % size)


def _drop_last_sample(obj: Any) -> Any:
    """``obj`` without its last sample: the last row of each tensor, the last item of lists."""
    def walk(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            return o[:-1] if o.dim() else o  # a 0-dim value is per batch, not per sample
        if isinstance(o, Mapping):
            return rebuild_mapping(o, {k: walk(v) for k, v in o.items()})
        if isinstance(o, tuple) and hasattr(o, "_fields"):
            return type(o)(*(walk(v) for v in o))
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            new = copy.copy(cast(Any, o))
            for f in dataclasses.fields(o):
                object.__setattr__(new, f.name, walk(getattr(o, f.name)))
            return new
        if isinstance(o, (list, tuple)):
            if next(iter_tensors(o), None) is not None:  # a structure
                return rebuild_sequence(o, [walk(v) for v in o])
            return o[:-1]  # a batch of per-sample objects
        return o

    return walk(obj)


@overload
def split_between_processes(items: Dataset[Item], *, pad: bool = False) -> Dataset[Item]: ...


@overload
def split_between_processes(items: T, *, pad: bool = False) -> T: ...


@checked
def split_between_processes(items: Any, *, pad: bool = False) -> Any:
    """This rank's contiguous part of ``items``: any sequence with ``len()`` and indexing.

    Lists, tuples, tensors and arrays (along dim 0) and ranges come back sliced, of their own
    type; a Hugging Face ``datasets.Dataset`` through its ``select()``; any other map-style
    dataset as a ``torch.utils.data.Subset`` (a view: nothing is loaded; typed as a
    ``Dataset``, not as your class); a dict splits each of its values.

    With ``k = ceil(len(items) / world_size)``, rank ``r`` gets items ``r*k`` to ``(r+1)*k``; the
    last ranks may get fewer, or none. ``pad=True`` gives every rank exactly ``k`` items, the
    short parts filled with copies of the last item, so that ``gather(results)[:len(items)]``
    is in the order of ``items``. A dict splits each of its values (all of the same length). In
    a single process ``items`` itself is returned.

    Examples:
        >>> from accel_ctx import split_between_processes
        >>> split_between_processes(["a cat", "a dog", "a bird"])  # one process: everything
        ['a cat', 'a dog', 'a bird']
    """
    flag("split_between_processes", "pad", pad)
    where = _state.coordinates()
    world, rank = where.world_size, where.rank
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
            return parts
        new: Any = copy.copy(items)  # a dict subclass (OrderedDict, ...) keeps its type
        new.update(parts)
        return new
    _length(items, None)
    return _split(items, world, rank, pad)


def _length(value: Any, key: Any) -> int:
    splittable = (
        hasattr(value, "__len__") and hasattr(value, "__getitem__")
        and not isinstance(value, (str, bytes, bytearray, Mapping))
        and not (isinstance(value, torch.Tensor) and value.dim() == 0)
    )
    if splittable:
        return len(value)
    where = f" at key {key!r}" if key is not None else ""
    raise ConfigurationError(
        f"split_between_processes() cannot split a {type(value).__name__}{where}; give a "
        "sequence with len() and indexing (list, tuple, range, tensor or array along dim 0, a "
        "map-style Dataset, a datasets.Dataset) or a dict of them (convert iterators with "
        "list(); wrap a single string in a list)."
    )


def _split(value: Any, world: int, rank: int, pad: bool) -> Any:
    n = len(value)
    k = math.ceil(n / world)
    start, end = min(rank * k, n), min((rank + 1) * k, n)
    missing = k - (end - start) if pad and n else 0
    if isinstance(value, torch.Tensor):
        part = value[start:end]
        return part if missing == 0 else torch.cat(
            [part, value[-1:].expand(missing, *value.shape[1:])])
    if isinstance(value, (list, tuple)):
        seq: Any = value
        part = seq[start:end]
        return part if missing == 0 else part + type(value)([value[-1]] * missing)
    indices = [*range(start, end), *([n - 1] * missing)]
    if callable(getattr(value, "select", None)):  # a Hugging Face datasets.Dataset
        return value.select(indices)
    if hasattr(value, "__array__") and hasattr(value, "shape"):  # numpy and alike
        return value[indices]
    if isinstance(value, Sequence):  # range, a user's Sequence: a slice keeps its type
        return value[start:end] if missing == 0 else [*value[start:end], *[value[-1]] * missing]
    return Subset(value, indices)  # a map-style Dataset: a view, nothing loaded
