"""The public signatures say what happens on other ranks; checked by mypy, also run by pytest.

``mypy --strict tests/ranks/test_process_typing.py`` verifies the ``assert_type`` lines: both
``@on_main_process`` and ``@on_main_process()`` turn ``Callable[P, R]`` into
``Callable[P, R | None]``, the ``with`` form gives a bool, collectives keep their input's type.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset
from typing_extensions import assert_type

from accel_ctx import (
    broadcast,
    gather,
    gather_for_metrics,
    gather_object,
    on_last_process,
    on_local_main_process,
    on_main_process,
    on_process,
    reduce,
    split_between_processes,
)


@on_main_process
def bare(x: int, *, scale: float = 1.0) -> float:
    return x * scale


@on_main_process()
def called(name: str) -> str:
    return name


@on_local_main_process
def local() -> int:
    return 1


@on_last_process()
def last() -> int:
    return 2


@on_process(0)
def first(values: list[int]) -> int:
    return sum(values)


@on_main_process
async def fetch(url: str) -> bytes:
    return url.encode()


class Model:
    @on_main_process
    def save(self, path: str) -> str:
        return path


def test_decorated_functions_may_return_none() -> None:
    assert_type(bare(2, scale=0.5), "float | None")
    assert_type(called("a"), "str | None")
    assert_type(local(), "int | None")
    assert_type(last(), "int | None")
    assert_type(first([1, 2]), "int | None")
    assert_type(Model().save("p"), "str | None")
    pending = fetch("u")
    _ = assert_type(pending, Coroutine[Any, Any, bytes | None])  # awaitable on every rank
    assert asyncio.run(pending) == b"u"
    assert bare(2, scale=0.5) == 1.0 and called("a") == "a" and Model().save("p") == "p"


def test_with_form_gives_a_bool() -> None:
    with on_main_process() as here:
        assert_type(here, bool)
        assert here


def test_collectives_keep_the_input_type() -> None:
    pair = (torch.ones(1), torch.zeros(1))
    assert_type(gather(pair), tuple[torch.Tensor, torch.Tensor])
    assert_type(reduce({"a": torch.ones(1)}, "max"), dict[str, torch.Tensor])
    assert_type(broadcast(torch.ones(1)), torch.Tensor)
    assert_type(gather_for_metrics([1, 2]), list[int])
    assert_type(gather_object("x"), list[str])
    assert_type(split_between_processes(["a", "b"]), list[str])
    table = TensorDataset(torch.arange(4))
    # a map-style dataset comes back as a Subset on several ranks: typed as a Dataset
    assert_type(split_between_processes(table), Dataset[tuple[torch.Tensor, ...]])
    assert gather(pair) is pair
