"""A stock BatchSampler's batches cut from its sampler's order: the same batches, the same draws."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler, SequentialSampler

from accel_ctx._data.batches import batches

DATA = list(range(103))


def _samplers() -> list[tuple[str, Any]]:
    return [
        ("random", RandomSampler(DATA)),
        ("random, fewer samples", RandomSampler(DATA, num_samples=40)),
        ("random, two passes and a half", RandomSampler(DATA, num_samples=260)),
        ("random, with replacement", RandomSampler(DATA, replacement=True, num_samples=150)),
        ("sequential", SequentialSampler(DATA)),
        ("distributed", DistributedSampler(DATA, num_replicas=3, rank=1, seed=4)),
        ("random, the user's generator", RandomSampler(DATA, generator=torch.Generator())),
    ]


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("size", [1, 8, 103, 200])
@pytest.mark.parametrize("name", [name for name, _ in _samplers()])
def test_the_batches_and_the_random_draws_are_the_stock_batch_samplers(
        name: str, size: int, drop_last: bool) -> None:
    sampler = dict(_samplers())[name]
    stock = BatchSampler(sampler, size, drop_last)
    if isinstance(sampler, RandomSampler) and sampler.generator is not None:
        sampler.generator.manual_seed(7)
    torch.manual_seed(3)
    expected = list(stock)
    expected_state = torch.get_rng_state()
    if isinstance(sampler, RandomSampler) and sampler.generator is not None:
        sampler.generator.manual_seed(7)
    torch.manual_seed(3)
    got = list(batches(stock))
    assert got == expected
    assert all(type(batch) is list for batch in got)
    assert torch.equal(torch.get_rng_state(), expected_state)


def test_nothing_is_drawn_before_the_first_batch_is_asked_for() -> None:
    torch.manual_seed(0)
    it = batches(BatchSampler(RandomSampler(DATA), 8, False))
    state = torch.get_rng_state()
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(1)  # a seed set between iter() and the first batch decides the order
    first = next(it)
    torch.manual_seed(1)
    assert first == next(iter(BatchSampler(RandomSampler(DATA), 8, False)))


def test_a_users_generator_is_drawn_from_as_the_stock_sampler_draws_from_it() -> None:
    # a pass over the data per permutation: the second is drawn only when the first runs out
    def after_two_batches(source: Any) -> torch.Tensor:
        generator = torch.Generator().manual_seed(5)
        sampler = BatchSampler(RandomSampler(DATA, num_samples=206, generator=generator), 8, False)
        it = source(sampler)
        next(it), next(it)
        return generator.get_state()

    assert torch.equal(after_two_batches(batches), after_two_batches(iter))


def _python_calls(run: Any) -> int:
    calls = 0

    def count(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call":
            calls += 1

    sys.setprofile(count)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


def test_a_random_order_is_drawn_without_a_python_resume_per_index() -> None:
    # sharding walks every rank's batches: per index, the stock RandomSampler resumes a generator
    big = BatchSampler(RandomSampler(range(20_000)), 32, False)
    assert _python_calls(lambda: list(iter(big))) > 20_000
    assert _python_calls(lambda: list(batches(big))) < len(big) + 50  # one resume per batch


@pytest.mark.parametrize("replacement", [True, False])
def test_a_sampler_of_any_length_is_drawn_as_its_batches_are_asked_for(replacement: bool) -> None:
    from itertools import islice

    from ..workers.mingpt import lists_drawn_at_most

    # minGPT's RandomSampler(replacement=True, num_samples=int(1e10)): never taken whole
    huge = BatchSampler(RandomSampler(DATA, replacement=replacement, num_samples=int(1e10)), 8,
                        False)
    torch.manual_seed(3)
    expected = list(islice(iter(huge), 30))  # 240 indices: 8 lists of 32, or 3 permutations
    torch.manual_seed(3)
    with lists_drawn_at_most(8):
        got = list(islice(batches(huge), 30))
    assert got == expected
