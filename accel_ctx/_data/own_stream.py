"""A rank's own random stream stays its own while its epoch's order is drawn from rank 0's.

Scripts seed each rank differently (``manual_seed(s + rank)``) so that dropout, noise and
augmentations differ between ranks; borrowing rank 0's global state for the order must not make
every rank draw rank 0's numbers afterwards. So each rank's global generator is then put back to
its own state, moved on by exactly as many words as building the epoch drew from it: where the
same script under torchrun + DDP leaves it.

A loader's worker processes take their base seed from the rank's own stream too (as under DDP):
it decides no order, and workers seeded from rank 0's state would give every rank rank 0's
augmentations.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from .torch_private import builds_like_torch, starts_workers, stock_iterator

try:  # deprecated in torch; its iterator runs collectives of its own while it is built
    from torch.utils.data import IterDataPipe as _IterDataPipe
except ImportError:  # pragma: no cover - removed in a later torch
    _IterDataPipe = ()  # type: ignore[assignment,misc]

_ONE_SAMPLE = TensorDataset(torch.zeros(1))


def is_datapipe(dataset: object) -> bool:
    """A torchdata DataPipe (deprecated): its iterator broadcasts a seed while it is built."""
    return isinstance(dataset, _IterDataPipe)


# torch's CPU generator (mt19937) state: seed, words left before the next twist, seeded flag,
# index of the next word, then the 624 state words (as uint64); normal-sample caches follow.
_LEFT, _NEXT, _WORDS = slice(8, 12), slice(16, 24), slice(24, 24 + 624 * 8)
_MAX_TWISTS = 1 << 16  # ~40M words: far more than building an epoch's order draws


def _position(state: torch.Tensor) -> tuple[int, int]:
    """(words left before the next twist, index of the next word) of a CPU generator state."""
    return (int(state[_LEFT].view(torch.int32).item()),
            int(state[_NEXT].view(torch.int64).item()))


def words_drawn(before: torch.Tensor, after: torch.Tensor) -> int | None:
    """How many 32-bit words a CPU generator drew to get from ``before`` to ``after``.

    None when ``after`` is not a state ``before`` reaches by drawing (another seed, or more
    than ``_MAX_TWISTS`` twists away).
    """
    walker = torch.Generator()
    walker.set_state(before)
    target_words = after[_WORDS]
    target_next = _position(after)[1]
    drawn = 0
    for _ in range(_MAX_TWISTS):
        now = walker.get_state()
        left, next_word = _position(now)
        if torch.equal(now[_WORDS], target_words) and target_next >= next_word:
            rest = target_next - next_word
            if rest:
                torch.rand(rest, generator=walker)
            same = torch.equal(walker.get_state()[:_WORDS.stop], after[:_WORDS.stop])
            return drawn + rest if same else None
        torch.rand(left, generator=walker)  # through the next twist
        drawn += left
    return None


def advanced(state: torch.Tensor, words: int) -> torch.Tensor:
    """``state`` moved on by ``words`` 32-bit words (one per float32 ``rand`` sample)."""
    walker = torch.Generator()
    walker.set_state(state)
    while words > 0:
        chunk = min(words, 1 << 22)
        torch.rand(chunk, generator=walker)
        words -= chunk
    return walker.get_state()


@contextlib.contextmanager
def own_global_stream(
    borrowed: torch.Tensor, loader: DataLoader[Any] | None = None
) -> Iterator[None]:
    """Draw from rank 0's global state ``borrowed`` inside, then go back to this rank's own
    state, moved on by as many words as the block drew (what the same code would have drawn
    from it).

    ``loader``'s iterator, built inside, draws its worker processes' base seed from this rank's
    own state, as under torchrun + DDP: that seed decides no order, and workers seeded from
    rank 0's state would give every rank rank 0's augmentations.
    """
    own = torch.get_rng_state()
    # Ranks seeded alike (the common case): the block draws from this rank's own state, and
    # leaves it where the same code would have, however it draws (a reseed included).
    alike = torch.equal(own, borrowed)
    torch.set_rng_state(borrowed)
    try:
        if alike or loader is None or not _draws_worker_seed_globally(loader):
            yield
        else:
            with _worker_seed_from(loader, own):
                yield
    finally:
        after = torch.get_rng_state()
        if not alike:
            _own_moved_on(own, borrowed, after)


def _draws_worker_seed_globally(loader: DataLoader[Any]) -> bool:
    """Building ``loader``'s iterator starts worker processes, seeding them from torch's global
    generator (known for torch's own iterators only: a subclass may draw otherwise)."""
    return (loader.generator is None and starts_workers(loader) and builds_like_torch(loader)
            and not is_datapipe(loader.dataset))  # that seed is shared by design


@contextlib.contextmanager
def _worker_seed_from(loader: DataLoader[Any], own: torch.Tensor) -> Iterator[None]:
    """While the iterator is built, ``loader.generator`` (which its base seed is drawn from,
    and nothing else) is a generator at this rank's ``own`` state. The global stream, rank 0's,
    skips the words rank 0's base seed took, so the order is drawn from where rank 0 drew it."""
    stream = torch.Generator()
    stream.set_state(own)
    try:
        loader.generator = stream
    except (AttributeError, TypeError):  # a subclass's read-only generator: rank 0's, as before
        yield
        return
    try:
        torch.rand(_base_seed_words())
        yield
    finally:
        loader.generator = None


@functools.cache
def _base_seed_words() -> int:
    """32-bit words a DataLoader iterator draws for its workers' base seed (measured once)."""
    probe = torch.Generator()
    probe.manual_seed(0)
    before = probe.get_state()
    stock_iterator(DataLoader(_ONE_SAMPLE, generator=probe))
    return words_drawn(before, probe.get_state()) or 0


def _own_moved_on(own: torch.Tensor, borrowed: torch.Tensor, after: torch.Tensor) -> None:
    """This rank's ``own`` state moved on by the words drawn from ``borrowed`` to ``after``."""
    words = words_drawn(borrowed, after)
    # a stream that cannot be followed (reseeded inside): leave this rank's untouched
    torch.set_rng_state(advanced(own, words) if words is not None else own)
