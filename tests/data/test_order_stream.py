"""A rank's own global RNG stream after it built its epoch from rank 0's states."""

from __future__ import annotations

import torch

from accel_ctx._data.order import own_global_stream


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
