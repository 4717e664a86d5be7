"""Rank logic without processes: torch's fake process group makes this process rank r of w.

``distributed()`` adopts a process group formed before it, so with the "fake" backend one test
process can stand in for any rank of any world and check what that rank computes on its own:
its coordinates, its share of a DataLoader, its part of ``split_between_processes``, which
rank-only decorators run. Collectives on a fake group do not communicate, so only logic that
needs no other rank's data is checked here; the spawned tests check the rest on real ranks.
Expected values come from first principles (rank r of w takes batches r, r + w, ...).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils.data import DataLoader

from accel_ctx import (
    distributed,
    on_last_process,
    on_local_main_process,
    on_main_process,
    on_process,
    split_between_processes,
    state,
)

PAIRS = [(0, 2), (1, 2), (2, 3), (0, 5), (3, 5), (4, 5), (0, 8), (5, 8), (7, 8)]
N = 23  # samples: divides by none of the worlds, so every last round is incomplete


@pytest.fixture(params=PAIRS, ids=[f"rank{r}of{w}" for r, w in PAIRS])
def as_rank(request: pytest.FixtureRequest) -> Iterator[tuple[int, int]]:
    rank, world = request.param
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield rank, world
    finally:
        dist.destroy_process_group()


def test_state_gives_the_groups_coordinates(as_rank: tuple[int, int]) -> None:
    rank, world = as_rank
    with distributed():
        s = state()
        assert (s.rank, s.world_size) == (rank, world)
        # no launcher variables: one machine, as the group's creator most likely set up
        assert (s.local_rank, s.local_world_size, s.node_rank, s.num_nodes) == (rank, world, 0, 1)
        assert s.is_main_process == (rank == 0) and s.is_local_main_process == (rank == 0)
        assert s.device == torch.device("cpu")


def test_a_map_style_loader_gives_every_wth_sample_padded_from_the_start(
    as_rank: tuple[int, int],
) -> None:
    rank, world = as_rank
    own = list(range(rank, N, world))
    short = N % world  # ranks short .. w-1 lack a batch in the last round
    padding = [rank - short] if rank >= short else []  # the epoch's first batches again
    with distributed():
        loader = DataLoader(list(range(N)), batch_size=1)
        assert len(loader) == math.ceil(N / world)
        assert [int(b) for b in loader] == own + padding
        assert [int(b) for b in loader] == own + padding  # the next epoch: the same share


def test_drop_last_drops_the_incomplete_round(as_rank: tuple[int, int]) -> None:
    rank, world = as_rank
    batches = [[2 * i, 2 * i + 1] for i in range(N // 2)]  # 11 whole batches of 2
    rounds = len(batches) // world
    with distributed():
        loader = DataLoader(list(range(N)), batch_size=2, drop_last=True)
        assert len(loader) == rounds
        assert [b.tolist() for b in loader] == batches[: rounds * world][rank::world]


def test_uneven_batches_end_one_batch_early_on_the_ranks_without_one(
    as_rank: tuple[int, int],
) -> None:
    rank, world = as_rank
    batches = [list(range(i, min(i + 3, N))) for i in range(0, N, 3)]  # 8 batches, last of 2
    with distributed(even_batches=False):
        loader = DataLoader(list(range(N)), batch_size=3)
        assert len(loader) == len(batches) // world + (rank < len(batches) % world)
        assert [b.tolist() for b in loader] == batches[rank::world]


@pytest.mark.parametrize("items", [11, 5, 16])
def test_split_between_processes_gives_a_contiguous_part(
    as_rank: tuple[int, int], items: int
) -> None:
    rank, world = as_rank
    k = math.ceil(items / world)
    expected = list(range(items))[rank * k : (rank + 1) * k]
    with distributed():
        assert split_between_processes(list(range(items))) == expected
        assert split_between_processes(torch.arange(items)).tolist() == expected
        padded = split_between_processes(list(range(items)), pad=True)
        assert padded == expected + [items - 1] * (k - len(expected))
        parts = split_between_processes({"a": list(range(items)), "b": torch.arange(items)})
        assert parts["a"] == expected and parts["b"].tolist() == expected


def test_rank_only_decorators_run_on_exactly_the_ranks_they_name(as_rank: tuple[int, int]) -> None:
    rank, world = as_rank
    with distributed():
        assert on_main_process(lambda: "ran")() == ("ran" if rank == 0 else None)
        assert on_local_main_process(lambda: "ran")() == ("ran" if rank == 0 else None)
        assert on_last_process(lambda: "ran")() == ("ran" if rank == world - 1 else None)
        ran = [i for i in range(world) if on_process(i)(lambda: True)()]
        assert ran == [rank]
        with on_main_process() as here:
            assert here == (rank == 0)
        with on_process(world - 1) as here:
            assert here == (rank == world - 1)
