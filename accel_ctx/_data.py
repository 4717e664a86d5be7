"""Sharded iteration of any DataLoader, batches delivered on the device.

Map-style datasets are sharded by *batch index* over whatever the loader's sampler or
batch_sampler yields: the stock iterator (workers, pin_memory, persistent workers) is built as
usual but reads its indices through :class:`_IndexView`, which hands rank ``r`` the batches
``r, r + W, r + 2W, ...`` of the epoch. A rank therefore never loads another rank's samples.
With ``even_batches`` the last round is padded by wrapping around to the first batches of the
epoch. Iterable datasets are sharded the same way after fetching (each rank skips the others'
batches), since a stream cannot be indexed.

Every rank sees the same shuffling: before an epoch starts, rank 0's RNG state (the loader's
generator, else the global one) is copied to all ranks, *before* the stock iterator draws its
worker seed and the sampler draws its permutation, so a W-rank run sees at each step exactly
the samples of the one-process run with W times the batch size.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from . import _state
from ._tree import to_device

_EMPTY: Any = object()


@dataclass(frozen=True)
class ShardPlan:
    """Which batches of one epoch this rank takes."""

    rank: int = 0
    world: int = 1
    even: bool = True
    skip: int = 0  # global batches already consumed (checkpoint resume)

    def share(self, total: int) -> int:
        """Batches this rank gets out of ``total`` global batches."""
        remaining = max(total - self.skip, 0)
        if self.even or remaining == 0:
            return math.ceil(remaining / self.world)
        return remaining // self.world + (1 if self.rank < remaining % self.world else 0)


def _already_sharded(loader: DataLoader[Any]) -> bool:
    """The user's own DistributedSampler already gives each rank its share."""
    sampler = loader.sampler
    batch_sampler = loader.batch_sampler
    inner = getattr(batch_sampler, "sampler", None)
    return isinstance(sampler, DistributedSampler) or isinstance(inner, DistributedSampler)


def _draws_no_randomness(loader: DataLoader[Any]) -> bool:
    """In-order sampling (evaluation loaders): nothing to make the ranks agree on."""
    inner = getattr(loader.batch_sampler, "sampler", loader.sampler)
    return type(inner) is SequentialSampler and not isinstance(loader.dataset, IterableDataset)


def plan_for(loader: DataLoader[Any], stack: _state.Stack | None, skip: int = 0) -> ShardPlan:
    runtime = stack.dist if stack is not None else None
    if runtime is None or runtime.world_size == 1 or _already_sharded(loader):
        return ShardPlan(skip=skip)
    return ShardPlan(runtime.rank, runtime.world_size, runtime.options.even_batches, skip)


class _IndexView:
    """Stands in for the loader's index sampler while the stock iterator is built."""

    def __init__(self, original: Any, record: _state.LoaderRecord) -> None:
        self.original = original
        self._record = record

    def __iter__(self) -> Iterator[Any]:
        plan = self._record.plan or ShardPlan()  # None: iterated outside any scope
        indices = self._record.indices = _ShardedIndices(self.original, plan)
        return indices

    def __len__(self) -> int:
        # the stock iterator's own len(): this rank's share while a scope is open
        plan = self._record.plan
        total = len(self.original)
        return plan.share(total) if plan is not None else total


class _ShardedIndices:
    """Rank ``r``'s batches of one epoch, with the wrap-around padding of the last round.

    The source is the loader's index sampler (map-style: only indices are walked) or the stock
    iterator itself (iterable datasets: every batch is fetched, the others' are dropped).
    """

    def __init__(self, original: Any, plan: ShardPlan) -> None:
        self.original = original
        self.plan = plan
        self._source: Iterator[Any] | None = None
        self._peeked: Any = _EMPTY
        self._position = 0  # global batch index of the next batch from the source
        self._first_round: list[Any] = []
        self._padding: Iterator[Any] | None = None
        self.handed_out = 0  # batches this rank got so far
        self.padding_start: int | None = None  # first of them that is padding

    def prime(self) -> None:
        """Draw the sampler's randomness now (the source is otherwise built lazily)."""
        if self._source is None:
            self._source = iter(self.original)
            self._peeked = next(self._source, _EMPTY)

    def __iter__(self) -> _ShardedIndices:
        return self

    def _pull(self) -> Any:
        if self._source is None:
            # Lazily, like the stock batch sampler: the stock iterator draws its worker seed
            # between iter() and the first next(), and the sampler's permutation comes after.
            self._source = iter(self.original)
        if self._peeked is not _EMPTY:
            item, self._peeked = self._peeked, _EMPTY
            return item
        return next(self._source, _EMPTY)

    def __next__(self) -> Any:
        item = self._next()
        self.handed_out += 1
        return item

    def _next(self) -> Any:
        plan = self.plan
        if plan.world == 1 and plan.skip == 0:
            item = self._pull()
            if item is _EMPTY:
                raise StopIteration
            return item
        if self._padding is not None:
            return next(self._padding)
        while True:
            item = self._pull()
            if item is _EMPTY:
                self.padding_start = self.handed_out
                self._padding = iter(self._pad())
                return next(self._padding)
            index = self._position
            self._position += 1
            if index < plan.world and plan.even:  # they pad the last round, resumed or not
                self._first_round.append(item)
            if index < plan.skip:
                continue
            local = index - plan.skip
            if local % plan.world == plan.rank:
                return item

    def _pad(self) -> list[Any]:
        plan = self.plan
        total = self._position - plan.skip
        missing = -total % plan.world
        if not plan.even or total == 0 or missing == 0:
            return []
        # ranks total % W .. W-1 lack a batch in the last round; fill with the epoch's first ones
        first_missing = total % plan.world
        if plan.rank < first_missing:
            return []
        return [self._first_round[(plan.rank - first_missing) % len(self._first_round)]]


def sync_rng(loader: DataLoader[Any], runtime: Any) -> None:
    """Give every rank rank 0's sampling RNG, so all draw the same permutation."""
    generator = loader.generator
    state = generator.get_state() if generator is not None else torch.get_rng_state()
    device = torch.device("cpu")
    if runtime.backend == "nccl":  # NCCL alone cannot broadcast CPU tensors
        device = runtime.device
    buffer = state.to(device)
    dist.broadcast(buffer, src=0)
    state = buffer.cpu()
    if generator is not None:
        generator.set_state(state)
    else:
        torch.set_rng_state(state)


def _rng_snapshot(loader: DataLoader[Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    generator = loader.generator
    return torch.get_rng_state(), generator.get_state() if generator is not None else None


def scoped_iter(stack: _state.Stack, loader: DataLoader[Any], stock_iter: Any) -> Iterator[Any]:
    """The iterator a DataLoader hands out inside a scope."""
    record = _state.loader_record(loader)
    stack.session.first_iteration(loader, record)  # may set the resume fields below
    iterable = isinstance(loader.dataset, IterableDataset)
    skip, resume_rng = record.resume_skip, record.resume_rng
    record.resume_skip, record.resume_rng = 0, None
    plan = plan_for(loader, stack, skip)
    runtime = stack.dist
    # A resumed epoch replays its saved (already shared) start; the ranks' restored states stay.
    if (
        resume_rng is None
        and runtime is not None
        and runtime.world_size > 1
        and not _already_sharded(loader)
        and not _draws_no_randomness(loader)
    ):
        sync_rng(loader, runtime)
    record.epoch += 1
    record.yielded = 0
    record.epoch_plan = plan
    record.epoch_start_rng = _rng_snapshot(loader) if resume_rng is None else resume_rng
    if iterable:
        it = _build_stock(loader, record, None, stock_iter, resume_rng)
        shard: ShardPlan | None = plan
    else:
        if record.view is None or record.view.original is not _stock_index_sampler(loader):
            record.view = _IndexView(_stock_index_sampler(loader), record)
        it = _build_stock(loader, record, plan, stock_iter, resume_rng)
        shard = None
    length = _length(loader, stack, plan, iterable)
    device = runtime.device if runtime is not None else None
    scoped = ScopedIterator(it, stack.session, record, device, loader.pin_memory, length, shard)
    scoped._iteration.loader = loader  # gather_for_metrics reads its sampler
    return scoped


def _stock_index_sampler(loader: DataLoader[Any]) -> Any:
    return loader.batch_sampler if loader.batch_sampler is not None else loader.sampler


def _build_stock(
    loader: DataLoader[Any],
    record: _state.LoaderRecord,
    plan: ShardPlan | None,
    stock_iter: Any,
    replay_rng: tuple[torch.Tensor, torch.Tensor | None] | None,
) -> Iterator[Any]:
    record.plan = plan
    try:
        if replay_rng is None:
            return stock_iter()  # type: ignore[no-any-return]
        # Resume: replay the epoch's start from the RNG state saved with the checkpoint, so the
        # worker seed and the permutation are the original ones, then return to the restored
        # mid-epoch state as if nothing had been drawn.
        with torch.random.fork_rng(devices=[]):
            generator = loader.generator
            saved_generator = generator.get_state() if generator is not None else None
            torch.set_rng_state(replay_rng[0])
            if generator is not None and replay_rng[1] is not None:
                generator.set_state(replay_rng[1])
            it = stock_iter()
            sampler_iter = getattr(it, "_sampler_iter", None)
            if isinstance(sampler_iter, _ShardedIndices):
                sampler_iter.prime()
            if generator is not None and saved_generator is not None:
                generator.set_state(saved_generator)
        return it  # type: ignore[no-any-return]
    finally:
        record.plan = None


def _length(
    loader: DataLoader[Any], stack: _state.Stack, plan: ShardPlan, iterable: bool
) -> int | None:
    try:
        if iterable:
            total = len(loader.dataset)  # type: ignore[arg-type]
            if loader.batch_size is not None:
                total = (
                    total // loader.batch_size
                    if loader.drop_last
                    else math.ceil(total / loader.batch_size)
                )
        else:
            total = len(_stock_index_sampler(loader))
    except TypeError:
        return None
    return plan.share(total)


def scoped_len(stack: _state.Stack, loader: DataLoader[Any], stock_len: Any) -> int:
    """``len(loader)`` inside a scope: this rank's number of batches."""
    plan = plan_for(loader, stack)
    if plan.world == 1:
        return stock_len()  # type: ignore[no-any-return]
    length = _length(loader, stack, plan, isinstance(loader.dataset, IterableDataset))
    if length is None:
        return stock_len()  # type: ignore[no-any-return]  # raises the stock TypeError
    return length


class ScopedIterator:
    """Wraps the stock iterator: iterable-dataset sharding, device transfer, position."""

    def __init__(
        self,
        it: Iterator[Any],
        session: _state.Session,
        record: _state.LoaderRecord,
        device: torch.device | None,
        pin_memory: bool,
        length: int | None,
        shard: ShardPlan | None,
    ) -> None:
        self._stock = it
        # iterable datasets cannot be indexed: shard the fetched batches with the same rules
        self._sharded = _ShardedIndices(it, shard) if shard is not None else None
        self._it: Iterator[Any] = self._sharded if self._sharded is not None else it
        self._session = session
        self._record = record
        self._device = device if device is not None and device.type != "cpu" else None
        self._non_blocking = pin_memory and device is not None and device.type == "cuda"
        self._iteration = _state.LoaderIteration(length)
        self._pending: Any = _EMPTY
        self._registered = False
        self._exhausted = False

    def __iter__(self) -> ScopedIterator:
        return self

    def __len__(self) -> int:
        if self._iteration.length is not None:
            return self._iteration.length
        return len(self._stock)  # type: ignore[arg-type]

    def _is_padding(self, index: int) -> bool:
        # iterable datasets: padded here; map-style: by the index view of this epoch
        indices = self._sharded if self._sharded is not None else self._record.indices
        start = indices.padding_start if isinstance(indices, _ShardedIndices) else None
        return start is not None and index >= start

    def __next__(self) -> Any:
        if self._exhausted:
            raise StopIteration
        if self._pending is not _EMPTY:
            batch, self._pending = self._pending, _EMPTY
        else:
            batch = next(self._it, _EMPTY)
        if batch is _EMPTY:
            self._finish()
            raise StopIteration
        iteration = self._iteration
        iteration.index += 1
        iteration.is_padding = self._is_padding(iteration.index)
        if iteration.length is not None:
            iteration.is_last = iteration.index >= iteration.length - 1
        else:  # unknown length: look one batch ahead to know whether this one is the last
            self._pending = next(self._it, _EMPTY)
            iteration.is_last = self._pending is _EMPTY
        if not self._registered:
            self._session.loaders.append(iteration)
            self._registered = True
        self._record.yielded += 1
        if self._device is not None:
            batch = to_device(batch, self._device, self._non_blocking)
        return batch

    def _finish(self) -> None:
        self._exhausted = True
        if self._registered:
            self._registered = False
            with contextlib.suppress(ValueError):
                self._session.loaders.remove(self._iteration)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._finish()
