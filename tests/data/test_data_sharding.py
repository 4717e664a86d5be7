"""The batch-index sharding rules, checked without processes (rank logic only)."""

from __future__ import annotations

import pytest

from accel_ctx._data.iterate import ShardPlan, _ShardedIndices


def _rank_batches(total: int, world: int, rank: int, skip: int = 0, even: bool = True) -> list[int]:
    return list(_ShardedIndices(range(total), ShardPlan(rank, world, even, skip)))


@pytest.mark.parametrize("total", [1, 4, 5, 7, 12])
@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_as_many_batches_and_padding_comes_from_the_start(total, world):
    shares = [_rank_batches(total, world, r) for r in range(world)]
    assert len({len(s) for s in shares}) == 1
    interleaved = [b for j in range(len(shares[0])) for s in shares for b in [s[j]]]
    assert interleaved[:total] == list(range(total))
    assert all(b < world for b in interleaved[total:])  # the epoch's first batches, again


@pytest.mark.parametrize("skip", [2, 4])
def test_a_resumed_epoch_gives_the_batches_it_would_have_given(skip):
    for rank in range(2):
        whole = _rank_batches(5, 2, rank)
        resumed = _rank_batches(5, 2, rank, skip=skip)
        assert whole[skip // 2:] == resumed


def test_exact_tail_without_padding():
    assert [_rank_batches(5, 2, r, even=False) for r in range(2)] == [[0, 2, 4], [1, 3]]
