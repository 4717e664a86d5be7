"""Which batches of an epoch each rank takes: the batch-index sharding rules, process-free.

The epoch's batches (after ``skip`` already consumed ones) form *rounds* of ``W`` consecutive
batches; rank ``r`` takes batch ``r`` of every round. What happens to an incomplete last round
depends on the loader and on ``distributed(even_batches=...)``:

* ``DataLoader(drop_last=True)``: the incomplete round is dropped, so W ranks with batch ``b``
  see exactly the batches of one process with batch ``W * b`` and ``drop_last=True``;
* ``even_batches=True`` (default): the ranks lacking a batch get one of the epoch's first
  batches again (padding, which ``gather_for_metrics`` drops);
* ``even_batches=False``: the ranks lacking a batch simply stop one batch earlier (the *tail*
  is the batch only some ranks get; see ``_engines.join``).

Dropping and stopping read a whole round before handing out this rank's batch of it, so a rank
knows whether its batch belongs to an incomplete round before anyone trains on it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any

from ..errors import ConfigurationError
from .batches import batches

EMPTY: Any = object()


@dataclass(frozen=True)
class ShardPlan:
    """Which batches of one epoch this rank takes."""

    rank: int = 0
    world: int = 1
    even: bool = True
    skip: int = 0  # global batches already consumed (checkpoint resume)
    drop: bool = False  # the loader drops its incomplete last batch: drop the incomplete round

    def share(self, total: int) -> int:
        """Batches this rank gets out of ``total`` global batches."""
        remaining = max(total - self.skip, 0)
        if self.drop:
            return remaining // self.world
        if self.even or remaining == 0:
            return math.ceil(remaining / self.world)
        return remaining // self.world + (1 if self.rank < remaining % self.world else 0)

    def full_rounds(self, total: int) -> int:
        """Batches every rank gets (the complete rounds)."""
        return max(total - self.skip, 0) // self.world

    def end(self, total: int) -> int:
        """Global batches consumed (skipped ones included) once the epoch is over."""
        if self.drop:
            return self.skip + self.world * self.full_rounds(total)
        return total


def check_skip(batches: int, total: int | None, plan: ShardPlan) -> None:
    """Refuse ``skip_first_batches(loader, batches)`` past the end of the epoch ``plan`` (its
    ``skip``: a resume pending) would run: the epoch would end at once, without a word. The
    largest share counts (rank 0's), so every rank decides alike."""
    if total is None:
        return  # a stream without len(): its end is not known before it comes
    largest = ShardPlan(0, plan.world, plan.even, plan.skip, plan.drop).share(total)
    if batches <= largest:
        return
    each = "this rank's" if plan.world > 1 else "the"
    over = f" (of {total} over {plan.world} ranks)" if plan.world > 1 else ""
    raise ConfigurationError(
        f"skip_first_batches(loader, {batches}): {each} epoch has {largest} batches{over}, so "
        f"skipping {batches} would leave the epoch empty. Give the number of batches this rank "
        f"consumed in the epoch (at most {largest}); to resume where a run stopped, save "
        "loader_state(loader) and pass it to load_loader_state().")


class ShardedIndices:
    """Rank ``r``'s batches of one epoch, by the rules of :class:`ShardPlan`.

    The source is the loader's index sampler (map-style: only indices are walked) or the stock
    iterator itself (iterable datasets: every batch is fetched, the others' are dropped).
    """

    def __init__(self, original: Any, plan: ShardPlan) -> None:
        self.original = original
        self.plan = plan
        self._source: Iterator[Any] | None = None
        self._peeked: Any = EMPTY
        self._position = 0  # global batch index of the next batch from the source
        self._first_round: list[Any] = []
        self._padding: Iterator[Any] | None = None
        self._ended = False
        self.first: Any = EMPTY  # the epoch's first batch from the source (order fingerprint)
        self.handed_out = 0  # batches this rank got so far
        self.padding_start: int | None = None  # first of them that is padding
        self.incomplete = False  # the source ended inside a round (even_batches=False)
        self.tail_start: int | None = None  # this rank's batch of that incomplete round

    def prime(self) -> Any:
        """Draw the sampler's randomness now (the source is otherwise built lazily).

        Returns the epoch's first batch from the source (``EMPTY`` for an empty epoch).
        """
        if self._source is None:
            self._source = batches(self.original)
            self._peeked = self._fetch()
        return self.first

    def __iter__(self) -> ShardedIndices:
        return self

    def _fetch(self) -> Any:
        assert self._source is not None
        item = next(self._source, EMPTY)
        if self.first is EMPTY:
            self.first = item
        return item

    def _pull(self) -> Any:
        if self._source is None:
            # Lazily, like the stock batch sampler: the stock iterator draws its worker seed
            # between iter() and the first next(), and the sampler's permutation comes after.
            self._source = batches(self.original)
        if self._peeked is not EMPTY:
            item, self._peeked = self._peeked, EMPTY
            return item
        return self._fetch()

    def __next__(self) -> Any:
        item = self._next()
        self.handed_out += 1
        return item

    def _next(self) -> Any:
        plan = self.plan
        if plan.world == 1 and plan.skip == 0:
            item = self._pull()
            if item is EMPTY:
                raise StopIteration
            return item
        if plan.drop or not plan.even:
            return self._next_of_round()
        if self._padding is not None:
            return next(self._padding)
        source = self._source
        position = self._position
        if (source is not None and self._peeked is EMPTY and position >= plan.world
                and position >= plan.skip and (position - plan.skip) % plan.world
                == (plan.rank + 1) % plan.world):
            # Past the first round, this rank's batch is the last of the next W: the others'
            # between are passed over at C speed. A round cut short by the end: the padding.
            round_ = [*islice(source, plan.world)]
            if len(round_) == plan.world:
                self._position = position + plan.world
                return round_[-1]
            self._position = position + len(round_)  # the others' batches of the last round
            return self._start_padding()
        while True:
            source = self._source
            if source is not None and self._peeked is EMPTY:
                # ``self._pull()``, inlined: every batch of every rank of a sharded epoch
                item = next(source, EMPTY)
                if self.first is EMPTY:
                    self.first = item
            else:
                item = self._pull()
            if item is EMPTY:
                return self._start_padding()
            index = self._position
            self._position += 1
            if index < plan.world:  # they pad the last round, resumed or not
                self._first_round.append(item)
            if index < plan.skip:
                continue
            local = index - plan.skip
            if local % plan.world == plan.rank:
                return item

    def _start_padding(self) -> Any:
        """The source ended: hand out this rank's padding, if its last round lacks a batch."""
        self.padding_start = self.handed_out
        self._padding = iter(self._pad())
        return next(self._padding)

    def _next_of_round(self) -> Any:
        """Read one whole round, then hand out this rank's batch of it."""
        if self._ended:
            raise StopIteration
        plan = self.plan
        mine: Any = EMPTY
        count = 0
        while count < plan.world:
            item = self._pull()
            if item is EMPTY:
                break
            index = self._position
            self._position += 1
            if index < plan.skip:
                continue
            if count == plan.rank:
                mine = item
            count += 1
        if count == plan.world:
            return mine
        self._ended = True  # the source ended: ``count`` batches of an incomplete round
        self.incomplete = count > 0 and not plan.drop
        if plan.drop or mine is EMPTY:
            raise StopIteration
        self.tail_start = self.handed_out
        return mine

    def _pad(self) -> list[Any]:
        plan = self.plan
        total = self._position - plan.skip
        missing = -total % plan.world
        if total == 0 or missing == 0:
            return []
        # ranks total % W .. W-1 lack a batch in the last round; fill with the epoch's first ones
        first_missing = total % plan.world
        if plan.rank < first_missing:
            return []
        return [self._first_round[(plan.rank - first_missing) % len(self._first_round)]]
