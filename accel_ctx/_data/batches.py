"""An epoch's batches of indices from a stock ``BatchSampler``, cut from its sampler's order.

Sharding walks every rank's batches of an epoch to hand out this rank's. Through the stock
``BatchSampler`` over a ``RandomSampler``, each index is one resume of a Python generator:
over two ranks, twice as many as a ``DistributedSampler`` loop pays for its own share. Where
the sampler draws its whole order at its first index anyway (``RandomSampler`` with its own
generator, ``SequentialSampler``, ``DistributedSampler``), the order is taken at that moment and
the batches are slices of it: the same lists, the same random draws at the same point. The
order is read a list at a time (a permutation, or 32 draws with replacement), as the batches
need it: a sampler of any length (``num_samples=int(1e10)``) streams.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler, SequentialSampler


def batches(index_sampler: Any) -> Iterator[Any]:
    """``iter(index_sampler)``: for a stock ``BatchSampler`` over a sampler that draws its order
    at once, the same batches sliced from that order."""
    if type(index_sampler) is BatchSampler:
        sampler: Any = index_sampler.sampler
        kind = type(sampler)
        # RandomSampler with a generator of the user's: it draws a permutation per pass over the
        # data, lazily; taking them all at once would draw them before the user's other draws
        if kind is SequentialSampler or kind is DistributedSampler or (
                kind is RandomSampler and sampler.generator is None):
            return _sliced(index_sampler, sampler)
    return iter(index_sampler)


def _sliced(batch_sampler: BatchSampler, sampler: Any) -> Iterator[list[int]]:
    # A generator, like the stock one: nothing is drawn before the first batch is asked for.
    size, drop_last = batch_sampler.batch_size, batch_sampler.drop_last
    if type(sampler) is SequentialSampler:
        count = len(sampler)
        stop = count - count % size if drop_last else count
        yield from map(list, map(range(count).__getitem__, _cuts(stop, size)))
        return
    # The order streams, a list (a permutation, 32 draws with replacement) at a time: a sampler
    # may be of any length (minGPT's num_samples=int(1e10)); a usual epoch is one list.
    rest: list[int] = []
    for part in _drawn(iter(sampler), len(sampler)):
        order = rest + part if rest else part
        stop = len(order) - len(order) % size
        yield from map(order.__getitem__, _cuts(stop, size))
        rest = order[stop:]
    if rest and not drop_last:
        yield rest


def _cuts(stop: int, size: int) -> Iterator[slice]:
    return map(slice, range(0, stop, size), range(size, stop + size, size))


_LIST_ITERATOR: type[Iterator[Any]] = type(iter([]))


def _drawn(indices: Iterator[int], length: int) -> Iterator[list[int]]:
    """The ``length`` indices of a sampler's pass, in the lists it draws them in. A generator
    delegating to a list (``yield from perm.tolist()``, as ``RandomSampler`` does) is resumed
    once per list, the list read on its own, and not resumed past its last index:
    ``RandomSampler`` would draw one more permutation there, cut to nothing, from the generator
    it made for this pass alone."""
    if not isinstance(indices, types.GeneratorType):
        yield list(indices)  # DistributedSampler: iter() of the list it made
        return
    for index in indices:
        part = [index]
        inner = indices.gi_yieldfrom
        if type(inner) is _LIST_ITERATOR:
            # what the generator would hand out next, item by item: its remaining list
            part.extend(inner)
        if len(part) >= length:
            yield part[:length]
            return
        length -= len(part)
        yield part
