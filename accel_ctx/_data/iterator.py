"""The iterator a DataLoader hands out inside a scope: sharding of streams, batches on the
device, this rank's position in the epoch, the end of a pass (an evaluation is judged then),
and the uneven last round under DDP's Join.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from .._engines.join import UnevenTail
from .._kernel import state as _state
from .._kernel.session import LoaderIteration
from . import eval_passes as _eval_passes
from . import records as _records
from .sequence_split import split_batch
from .shard import EMPTY as _EMPTY
from .shard import ShardedIndices as _ShardedIndices
from .shard import ShardPlan
from .transfer import BatchMover


class ScopedIterator:
    """Wraps the stock iterator: iterable-dataset sharding, device transfer, position."""

    def __init__(
        self,
        it: Iterator[Any],
        stack: _state.Stack,
        record: _records.LoaderRecord,
        loader_pass: _records.LoaderPass,
        pin_memory: bool,
        length: int | None,
        plan: ShardPlan,
        shard: ShardPlan | None,
        total: int | None,
    ) -> None:
        job = stack.job
        device = job.device if job is not None else None
        self._job = job
        self._plan = plan
        self._total = total
        self._stock = it
        # iterable datasets cannot be indexed: shard the fetched batches with the same rules
        self._sharded = _ShardedIndices(it, shard) if shard is not None else None
        self._it: Iterator[Any] = self._sharded if self._sharded is not None else it
        # this epoch's sharding: iterable datasets here, map-style in the index view, which
        # building the stock iterator just iterated (a later iter() of the loader replaces
        # the record's, not this iterator's)
        indices = self._sharded if self._sharded is not None else record.indices
        self._indices = indices if isinstance(indices, _ShardedIndices) else None
        self._session = stack.session
        self._before_batch = stack.hooks.before_batch
        self._record = record
        self._pass = loader_pass
        self._device = device if device is not None and device.type != "cpu" else None
        self._move = BatchMover(self._device, pin_memory) if self._device is not None else None
        self._sequence = job.sequence if job is not None else None  # sp=: slice the sequences
        self._length = length
        # even_batches=False: the ranks' last batches differ; every rank ends its accumulation
        # group with the complete rounds, and the incomplete round runs under DDP's Join
        uneven = job is not None and plan.world > 1 and not plan.even and not plan.drop
        self._tail = UnevenTail(job) if job is not None and uneven else None
        group_length = plan.full_rounds(total) if uneven and total is not None else length
        self._iteration = LoaderIteration(group_length, self._tail)
        self._pending: Any = _EMPTY
        self._registered = False
        self._exhausted = False

    def __iter__(self) -> ScopedIterator:
        return self

    def __len__(self) -> int:
        if self._length is not None:
            return self._length
        return len(self._stock)  # type: ignore[arg-type]

    def indices(self) -> _ShardedIndices | None:
        """This epoch's sharding (iterable datasets: here; map-style: the index view's)."""
        return self._indices

    def __next__(self) -> Any:
        if self._exhausted:
            raise StopIteration
        for before in self._before_batch:  # a step boundary: resumable() may save here
            before(self._session)
        if self._pending is not _EMPTY:
            batch, self._pending = self._pending, _EMPTY
        else:
            batch = next(self._it, _EMPTY)
        indices = self._indices
        if batch is _EMPTY:
            if not self._pass.exhausted:
                self._pass.exhausted = True
                self._judge_pass()
            self._finish()
            if self._tail is not None and indices is not None and indices.incomplete:
                self._tail.finish(indices.tail_start is not None)
            raise StopIteration
        iteration = self._iteration
        iteration.index += 1
        start = indices.padding_start if indices is not None else None
        iteration.is_padding = start is not None and iteration.index >= start
        tail = indices.tail_start if indices is not None else None
        if iteration.length is not None:
            iteration.is_last = iteration.index >= iteration.length - 1
        else:  # unknown length: look one batch ahead to know whether this one is the last
            self._pending = next(self._it, _EMPTY)
            iteration.is_last = self._pending is _EMPTY or tail == iteration.index + 1
        iteration.at_end = (iteration.index >= self._length - 1 if self._length is not None
                            else self._pending is _EMPTY)
        if tail == iteration.index and self._tail is not None:
            self._tail.enter(iteration.index)
        if not self._registered:
            self._session.loaders.append(iteration)
            self._registered = True
        self._record.yielded += 1
        if self._move is not None:  # pinned batches: non-blocking, on a side stream
            batch = self._move(batch)
        if self._sequence is not None:
            batch = split_batch(self._sequence, batch)
        return batch

    def _judge_pass(self) -> None:
        """The pass ran to its end: run without gradients, with no backward, an evaluation."""
        job, loader_pass = self._job, self._pass
        if (job is None or self._plan.world == 1 or loader_pass.collectives_start is None
                or self._session.backward_calls != loader_pass.backward_start):
            return
        no_grad = loader_pass.no_grad
        if no_grad is not True and job.root.no_grad_forwards == no_grad:
            return  # no model ran without gradients: a look at the data, not an evaluation
        loader = self._iteration.loader
        gathers = job.root.metric_gathers - loader_pass.metric_gathers_start
        _eval_passes.pass_ended(job, loader, loader_pass.where, self._plan, self._total,
                                loader_pass.collectives_start, gathers)

    def _finish(self) -> None:
        self._exhausted = True
        if self._registered:
            self._registered = False
            with contextlib.suppress(ValueError):
                self._session.loaders.remove(self._iteration)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._finish()
