"""Sharded iteration of any DataLoader, batches delivered on the device.

Map-style datasets are sharded by *batch index* over whatever the loader's sampler or
batch_sampler yields: the stock iterator (workers, pin_memory, persistent workers) is built as
usual but reads its indices through :class:`_IndexView`, which hands rank ``r`` the batches
``r, r + W, r + 2W, ...`` of the epoch (the rules, for the last round too, are in ``_data.shard``).
A rank therefore never loads another rank's samples. Iterable datasets are sharded the same
way after fetching (each rank skips the others' batches), since a stream cannot be indexed.

Every rank sees the same shuffling: before an epoch draws its order, every generator that may
decide it gets rank 0's state, and the ranks check they drew the same first batch
(``_data.order``), so a W-rank run sees at each step exactly the samples of the one-process
run with W times the batch size. With ``even_batches=False`` the batch only some ranks get is
trained under DDP's Join (``_engines.join``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from .._job.coordinates import Coordinates
from .._job.progress import here
from .._kernel import state as _state
from .._kernel.session import Session
from .._warn import warn_user
from ..errors import ConfigurationError
from . import eval_passes as _eval_passes
from . import order as _data_order
from . import records as _records
from .epochs import tell_epoch
from .iterator import ScopedIterator
from .shard import EMPTY as _EMPTY
from .shard import ShardedIndices as _ShardedIndices
from .shard import ShardPlan, check_skip
from .torch_private import sampler_iterator

__all__ = ["ScopedIterator", "ShardPlan", "plan_for", "scoped_iter", "scoped_len"]


def _own_sampler(loader: DataLoader[Any]) -> DistributedSampler[Any] | None:
    """The user's own DistributedSampler (the loader's, or its batch sampler's), if any."""
    for sampler in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
        if isinstance(sampler, DistributedSampler):
            return sampler
    return None


def _already_sharded(loader: DataLoader[Any]) -> bool:
    """The user's own DistributedSampler already gives each rank its share."""
    return _own_sampler(loader) is not None


def _draws_no_randomness(loader: DataLoader[Any]) -> bool:
    """In-order sampling (evaluation loaders): nothing to make the ranks agree on."""
    batch_sampler = loader.batch_sampler
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        return False  # a custom batch sampler may shuffle, whatever sampler it holds
    inner = batch_sampler.sampler if batch_sampler is not None else loader.sampler
    return type(inner) is SequentialSampler and not isinstance(loader.dataset, IterableDataset)


def _drops_last(loader: DataLoader[Any]) -> bool:
    """The loader drops an incomplete last batch (``drop_last``, also a batch sampler's)."""
    if loader.batch_size is None and loader.batch_sampler is None:
        return False
    return bool(loader.drop_last) or getattr(loader.batch_sampler, "drop_last", False) is True


def _check_own_sampler(sampler: DistributedSampler[Any], where: Coordinates) -> None:
    """The user's DistributedSampler under tp=/sp=/pp=: the ranks that share a batch must draw
    the same one, so it must count data-parallel ranks, not every rank."""
    if where.sharers > 1 and (sampler.num_replicas, sampler.rank) != (where.dp_size,
                                                                        where.dp_rank):
        raise ConfigurationError(
            f"DistributedSampler(num_replicas={sampler.num_replicas}, rank={sampler.rank}) on "
            f"rank {where.rank}, where groups of {where.sharers} ranks (tp=, sp= or pp=) share "
            "each batch: it would give every rank of a group other samples. Pass "
            "num_replicas=state().dp_size, rank=state().dp_rank, or drop the sampler "
            "(accel_ctx then gives each group its share).")


def plan_for(loader: DataLoader[Any], stack: _state.Stack | None, skip: int = 0) -> ShardPlan:
    job = stack.job if stack is not None else None
    # data-parallel coordinates: the ranks of a tensor-parallel group get the same batches
    # and over replica groups too: group g's ranks take the g-th block of dp_size shares
    own = _own_sampler(loader)
    if job is not None and own is not None:
        _check_own_sampler(own, job.coordinates)
    if job is None or own is not None:
        return ShardPlan(skip=skip)
    where, launch = job.coordinates, job.launch
    size = where.dp_size * launch.replica_groups
    if size == 1:
        return ShardPlan(skip=skip)
    return ShardPlan(launch.replica_group * where.dp_size + where.dp_rank, size,
                     job.options.even_batches, skip, _drops_last(loader))


class _IndexView:
    """Stands in for the loader's index sampler while the stock iterator is built."""

    def __init__(self, original: Any, record: _records.LoaderRecord) -> None:
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


def scoped_iter(stack: _state.Stack, loader: DataLoader[Any], stock_iter: Any) -> Iterator[Any]:
    """The iterator a DataLoader hands out inside a scope."""
    record = _records.loader_record(loader)
    if stack.session.first_iteration(loader, record):  # may set the resume fields below
        for met in stack.hooks.loader_met:  # a healing replica group's position wins
            met(loader, record, stack.session)
    session = stack.session
    job = stack.job
    if job is not None and torch.is_grad_enabled():  # training goes on: judge an evaluation
        _eval_passes.verdict(job)
    previous = record.last_pass
    if previous is not None and _was_a_peek(previous, session):
        # that pass was not an epoch: this one is the epoch it began, from the same position
        record.epoch -= 1
        record.resume_skip, record.resume_rng, record.skip_batches = previous.resume
    if double_skip(record, record.skip_batches):  # a position load_state applied just now
        record.skip_batches = 0
    iterable = isinstance(loader.dataset, IterableDataset)
    skip, resume_rng = record.resume_skip, record.resume_rng
    this_pass = _records.LoaderPass(session, (skip, resume_rng, record.skip_batches))
    record.last_pass = None  # set once the pass has started
    record.resume_skip, record.resume_rng = 0, None
    if record.skip_batches:  # skip_first_batches(): this rank's batches, W global ones each
        batches, record.skip_batches = record.skip_batches, 0
        check_skip(batches, _total(loader, iterable), plan_for(loader, stack, skip))
        skip += batches * plan_for(loader, stack).world
    plan = plan_for(loader, stack, skip)
    record.epoch += 1
    tell_epoch(loader, record)
    record.yielded = 0
    record.epoch_plan = plan
    if not iterable and (
        not isinstance(record.view, _IndexView)
        or record.view.original is not _stock_index_sampler(loader)
    ):
        record.view = _IndexView(_stock_index_sampler(loader), record)
    length = _length(loader, stack, plan, iterable)

    def build() -> ScopedIterator:
        it = _build_stock(loader, record, None if iterable else plan, stock_iter, resume_rng)
        scoped = ScopedIterator(it, stack, record, this_pass, loader.pin_memory, length, plan,
                                plan if iterable else None, _total(loader, iterable))
        scoped._iteration.loader = loader  # gather_for_metrics reads its sampler
        return scoped

    # A resumed epoch replays its saved (already shared) start; the ranks' restored states stay.
    if (
        resume_rng is None
        and job is not None
        and job.world_size > 1
        and not _already_sharded(loader)
        and not _draws_no_randomness(loader)
    ):
        it, states, generators = _data_order.shared_start(loader, job, build, _first_batch)
        record.epoch_start_rng = _rng_snapshot(loader, states, generators)
    else:
        record.epoch_start_rng = _rng_snapshot(loader) if resume_rng is None else resume_rng
        it = build()
    if job is not None and plan.world > 1:  # an evaluation pass would be judged (_eval_passes)
        this_pass.collectives_start = _eval_passes.collectives_so_far(job)
        this_pass.metric_gathers_start = job.root.metric_gathers
        this_pass.no_grad = True if not torch.is_grad_enabled() else job.root.no_grad_forwards
        this_pass.where = here()
    record.last_pass = this_pass
    return it


def double_skip(record: _records.LoaderRecord, batches: int) -> bool:
    """``skip_first_batches(loader, batches)`` on a loader whose position a checkpoint restored
    (Accelerate's resume: ``load_state``, then skip the batches seen) would skip them twice, the
    restored position skipping them already: it is dropped, with a warning (rank 0)."""
    if not (batches and record.resume_skip):
        return False
    if _state.coordinates().rank == 0:
        warn_user(
            f"skip_first_batches(loader, {batches}) ignored: load_state() (or "
            "load_loader_state()) already restored this loader's position, "
            f"{record.resume_skip} batches into its epoch (all ranks together), and its next "
            f"iteration resumes there; skipping {batches} more would drop batches of the epoch "
            "without training on them. Fix: drop the skip_first_batches() call after load_state().")
    return True


def _was_a_peek(previous: _records.LoaderPass, session: Session) -> bool:
    """The loader's previous pass, in these scopes, was left before its end with nothing
    trained in it."""
    return (not previous.exhausted and previous.session() is session
            and previous.backward_start == session.backward_calls)


def _first_batch(it: ScopedIterator) -> Any:
    """The epoch's first batch (of indices, for map-style datasets), drawn now."""
    indices = it.indices()
    return indices.prime() if indices is not None else _EMPTY


def _rng_snapshot(
    loader: DataLoader[Any],
    states: list[torch.Tensor] | None = None,
    generators: list[torch.Generator] | None = None,
) -> tuple[Any, ...]:
    """(global state, the loader generator's, the other order generators' in walk order)."""
    if generators is None or states is None:
        generators = _data_order.order_generators(loader)
        states = [torch.get_rng_state(), *(g.get_state() for g in generators)]
    own = loader.generator
    own_state = next((s for g, s in zip(generators, states[1:], strict=True) if g is own), None)
    if own is not None and own_state is None:  # the global generator passed as the loader's
        own_state = own.get_state()
    others = tuple(s for g, s in zip(generators, states[1:], strict=True) if g is not own)
    return states[0], own_state, others


def building_view(loader: DataLoader[Any]) -> Any | None:
    """The sharding view ``loader``'s iterator reads its indices through while a scope builds
    it (``DataLoader._index_sampler``, see ``torch_private``), else None."""
    record = _records.peek_loader_record(loader)
    return record.view if record is not None and record.plan is not None else None


def _stock_index_sampler(loader: DataLoader[Any]) -> Any:
    return loader.batch_sampler if loader.batch_sampler is not None else loader.sampler


def _build_stock(
    loader: DataLoader[Any],
    record: _records.LoaderRecord,
    plan: ShardPlan | None,
    stock_iter: Any,
    replay_rng: tuple[Any, ...] | None,
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
            others = [g for g in _data_order.order_generators(loader) if g is not generator]
            saved_others = replay_rng[2] if len(replay_rng) > 2 else ()
            if len(saved_others) == len(others):  # the sampler's generators: as drawn then
                for other, state in zip(others, saved_others, strict=True):
                    other.set_state(state)
            it = stock_iter()
            sampler_iter = sampler_iterator(it)
            if isinstance(sampler_iter, _ShardedIndices):
                sampler_iter.prime()
            if generator is not None and saved_generator is not None:
                generator.set_state(saved_generator)
        return it  # type: ignore[no-any-return]
    finally:
        record.plan = None


def _total(loader: DataLoader[Any], iterable: bool) -> int | None:
    """Global batches in one epoch (None: unknown, a stream without ``len``)."""
    try:
        if iterable:
            total = len(loader.dataset)  # type: ignore[arg-type]
            if loader.batch_size is not None:
                total = (
                    total // loader.batch_size
                    if loader.drop_last
                    else math.ceil(total / loader.batch_size)
                )
            return total
        return len(_stock_index_sampler(loader))
    except TypeError:
        return None


def _length(
    loader: DataLoader[Any], stack: _state.Stack | None, plan: ShardPlan, iterable: bool
) -> int | None:
    total = _total(loader, iterable)
    return plan.share(total) if total is not None else None


def scoped_len(stack: _state.Stack, loader: DataLoader[Any], stock_len: Any) -> int:
    """``len(loader)`` inside a scope: this rank's number of batches."""
    plan = plan_for(loader, stack)
    if plan.world == 1:
        return stock_len()  # type: ignore[no-any-return]
    length = _length(loader, stack, plan, isinstance(loader.dataset, IterableDataset))
    if length is None:
        return stock_len()  # type: ignore[no-any-return]  # raises the stock TypeError
    return length
