"""A rank's own global RNG stream after it built its epoch from rank 0's states."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from accel_ctx._data.own_stream import own_global_stream

from ..workers.data_trust import WorkerSeeds


def _draw_and_reseed() -> None:
    torch.rand(5)
    torch.manual_seed(9)  # a sampler that reseeds torch inside __iter__
    torch.rand(3)


def test_a_rank_seeded_as_rank_0_ends_where_the_same_code_leaves_rank_0() -> None:
    torch.manual_seed(4)
    _draw_and_reseed()
    expected = torch.get_rng_state()
    torch.manual_seed(4)
    with own_global_stream(torch.get_rng_state()):  # rank 0's state, equal to this rank's
        _draw_and_reseed()
    assert torch.equal(torch.get_rng_state(), expected)


def test_a_rank_seeded_apart_keeps_its_own_stream_moved_on_by_the_draws() -> None:
    torch.manual_seed(4)
    borrowed = torch.get_rng_state()
    torch.manual_seed(5)  # this rank's own seed (a per-rank seed)
    torch.rand(7)
    expected = torch.get_rng_state()
    torch.manual_seed(5)
    with own_global_stream(borrowed):
        torch.rand(7)
        drawn_from_rank_0 = torch.get_rng_state()
    assert torch.equal(torch.get_rng_state(), expected)
    assert not torch.equal(drawn_from_rank_0, expected)


class _ReadOnlyGeneratorLoader(DataLoader[tuple[int, int]]):
    """A subclass whose ``generator`` cannot be set to anything but None."""

    @property  # type: ignore[override]
    def generator(self) -> None:
        return None

    @generator.setter
    def generator(self, value: object) -> None:
        if value is not None:
            raise AttributeError("generator is read-only here")


def _epoch_start(loader: DataLoader[Any], borrowed: torch.Tensor | None) -> tuple[Any, ...]:
    """(first batch's ids, its worker's seed, the next two global draws) with the iterator
    built from rank 0's state ``borrowed`` (None: from this process's own)."""
    with own_global_stream(borrowed, loader) if borrowed is not None else nullcontext():
        ids, seeds = next(iter(loader))
    return ids.tolist(), int(seeds[0]), torch.rand(2).tolist()


def _seeded_state(seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.get_rng_state()


@pytest.mark.spawns  # the loaders' worker processes
def test_loader_workers_seeded_from_this_ranks_stream_the_order_from_rank_0s() -> None:
    def make(kind: type[DataLoader[Any]] = DataLoader) -> DataLoader[Any]:
        return kind(WorkerSeeds(8), batch_size=2, shuffle=True, num_workers=1)

    torch.manual_seed(4)
    rank_0_ids, rank_0_seed, _ = _epoch_start(make(), None)
    torch.manual_seed(5)  # this rank alone (its own seed): where DDP leaves it
    _, alone_seed, alone_next = _epoch_start(make(), None)
    borrowed = _seeded_state(4)
    torch.manual_seed(5)
    assert _epoch_start(make(), borrowed) == (rank_0_ids, alone_seed, alone_next)
    assert alone_seed != rank_0_seed
    # a loader whose generator cannot be set keeps rank 0's seed rather than failing
    torch.manual_seed(5)
    assert _epoch_start(make(_ReadOnlyGeneratorLoader), borrowed) == (
        rank_0_ids, rank_0_seed, alone_next)
