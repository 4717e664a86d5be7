"""Issue 11, points 1, 2 and 11, checked inside each spawned rank (all checks in one spawn).

Each section returns plain data; the test compares it with the real reference built in the
test process (one process with batch W*b) or, for Join, with hand-written DDP + Join.
"""

from __future__ import annotations

import os
import random
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    Sampler,
    WeightedRandomSampler,
    get_worker_info,
)

from accel_ctx import (
    accumulate,
    distributed,
    gather_for_metrics,
    load_state,
    save_state,
    state,
    wait_for_everyone,
)
from accel_ctx.errors import AccelCtxError

from .._timeouts import scaled
from .common import MLP, LoggingDataset, by_hand, make_data, params

# seconds a collective may wait in these scopes (a failure, not a hang), scaled where used
# (tests/_timeouts.py: a busy machine)
TIMEOUT = 60.0


# ---- data the users of the issue had ----------------------------------------------------------
class SizedStream(IterableDataset[torch.Tensor]):
    """A stream that knows its length (len(loader) is defined)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.arange(self.n, dtype=torch.float32).unsqueeze(1))

    def __len__(self) -> int:
        return self.n


class RowStream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """make_data() as a stream without len()."""

    def __init__(self, n: int) -> None:
        self.data = make_data(n)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return (self.data[i] for i in range(len(self.data)))


class HiddenGeneratorBatches(Sampler[list[int]]):
    """A custom batch sampler keeping its torch.Generator in a private attribute."""

    def __init__(self, n: int, batch: int, seed: int) -> None:
        self.n, self.batch = n, batch
        self._g = torch.Generator().manual_seed(seed)

    def __iter__(self) -> Iterator[list[int]]:
        order = torch.randperm(self.n, generator=self._g).tolist()
        for i in range(0, self.n, self.batch):
            yield order[i : i + self.batch]

    def __len__(self) -> int:
        return -(-self.n // self.batch)


class PythonRandomBatches(Sampler[list[int]]):
    """Shuffles with Python's random module: out of accel_ctx's reach."""

    def __init__(self, n: int, batch: int) -> None:
        self.n, self.batch = n, batch

    def __iter__(self) -> Iterator[list[int]]:
        order = list(range(self.n))
        random.shuffle(order)
        for i in range(0, self.n, self.batch):
            yield order[i : i + self.batch]

    def __len__(self) -> int:
        return -(-self.n // self.batch)


class NumpySampler(Sampler[int]):
    """Draws its permutation from NumPy's global generator."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(np.random.permutation(self.n).tolist())

    def __len__(self) -> int:
        return self.n


class ShuffledStream(IterableDataset[int]):
    """A stream with its own shuffle (Python's random): out of reach too."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        order = list(range(self.n))
        random.shuffle(order)
        return iter(order)


def _ids(loader: DataLoader[Any], epochs: int = 2) -> list[list[list[int]]]:
    """Per epoch, the sample ids of each batch this rank got."""
    out = []
    for _ in range(epochs):
        out.append([[int(i) for i in b[0]] for b in loader])
    return out


def _guard(fn: Callable[[], Any]) -> Any:
    """Run one check section; an error becomes data (the other sections still run)."""
    try:
        return fn()
    except Exception:
        return {"error": traceback.format_exc()}


# ---- point 1: drop_last ------------------------------------------------------------------------
def drop_sections(batch: int, n: int) -> dict[str, Any]:
    """The loaders of point 1; the test runs them in one process with W*b as the reference."""
    out: dict[str, Any] = {}
    torch.manual_seed(11)
    loader = DataLoader(LoggingDataset(n), batch_size=batch, shuffle=True, drop_last=True)
    out["map"] = _ids(loader)
    out["map_len"] = len(loader)
    stream = DataLoader(SizedStream(n), batch_size=batch, drop_last=True)
    out["stream"] = [[[int(v) for v in b.flatten()] for b in stream]]
    out["stream_len"] = len(stream)
    g = torch.Generator().manual_seed(5)
    sampler = BatchSampler(RandomSampler(range(n), generator=g), batch, drop_last=True)
    custom = DataLoader(LoggingDataset(n), batch_sampler=sampler)
    out["batch_sampler"] = _ids(custom)
    out["batch_sampler_len"] = len(custom)
    return out


def drop_training(batch: int, n: int) -> tuple[dict[str, torch.Tensor], int]:
    """Accumulation groups follow len(): the weights equal one process with W*b."""
    with accumulate(2):
        torch.manual_seed(0)
        model = MLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(make_data(n), batch_size=batch, shuffle=True, drop_last=True)
        for _ in range(2):
            for x, y in loader:
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        return params(model), state().step


def drop_last(batch: int, n: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with distributed(timeout=scaled(TIMEOUT)):
        out["loaders"] = drop_sections(batch, n)
        out["trained"] = drop_training(batch, n)
    with distributed(timeout=scaled(TIMEOUT), even_batches=False):  # drop_last wins: full rounds only
        out["uneven"] = drop_sections(batch, n)
    out["resume"] = _resume_after_a_finished_epoch(batch, n)
    return out


def _resume_after_a_finished_epoch(batch: int, n: int) -> dict[str, Any]:
    """A checkpoint taken at an epoch's end resumes with the next epoch, not a replay."""
    folder = os.environ["ACCEL_CTX_INIT_METHOD"].removeprefix("file://") + "-ckpt"
    out: dict[str, Any] = {}
    with distributed(timeout=scaled(TIMEOUT)):
        torch.manual_seed(21)
        loader = DataLoader(LoggingDataset(n), batch_size=batch, shuffle=True, drop_last=True)
        _ids(loader, 1)
        save_state(folder, loader=loader)
        out["straight"] = _ids(loader, 1)[0]
    with distributed(timeout=scaled(TIMEOUT)):
        torch.manual_seed(999)  # load_state brings back the saved states
        loader = DataLoader(LoggingDataset(n), batch_size=batch, shuffle=True, drop_last=True)
        load_state(folder, loader=loader)
        out["resumed"] = _ids(loader, 1)[0]
    return out


# ---- point 2: generators the sampler holds -------------------------------------------------------
def generator_sections(rank: int, batch: int, n: int) -> dict[str, Any]:
    """Loaders whose order generators are seeded per rank; rank 0's seeds are the reference."""
    out: dict[str, Any] = {}
    torch.manual_seed(1000 + rank)
    g = torch.Generator().manual_seed(100 + rank)
    loader = DataLoader(LoggingDataset(n), batch_size=batch,
                        sampler=RandomSampler(range(n), generator=g))
    out["sampler_generator"] = _ids(loader)
    g2 = torch.Generator().manual_seed(200 + rank)
    loader = DataLoader(LoggingDataset(n), batch_size=batch, sampler=RandomSampler(range(n)),
                        generator=g2)
    out["loader_generator_global_sampler"] = _ids(loader)
    custom = DataLoader(LoggingDataset(n), batch_sampler=HiddenGeneratorBatches(n, batch, 300 + rank))
    out["hidden_generator"] = _ids(custom)
    g3 = torch.Generator().manual_seed(400 + rank)
    weighted = WeightedRandomSampler(torch.linspace(1, 2, n), n, replacement=True, generator=g3)
    out["weighted"] = _ids(DataLoader(LoggingDataset(n), batch_size=batch, sampler=weighted))
    g4 = torch.Generator().manual_seed(500 + rank)
    wrapped = BatchSampler(RandomSampler(range(n), generator=g4), batch, drop_last=False)
    out["batch_sampler_generator"] = _ids(DataLoader(LoggingDataset(n), batch_sampler=wrapped))
    np.random.seed(7)  # NumPy seeded alike on every rank: agreeing orders are not refused
    out["numpy_alike"] = _ids(DataLoader(LoggingDataset(n), batch_size=batch, sampler=NumpySampler(n)))
    return out


class WorkerSeeds(Dataset[tuple[int, int]]):
    """Each sample: its id and the seed of the loader worker that loaded it."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, int]:
        info = get_worker_info()
        return i, info.seed if info is not None else -1


def worker_seeds(batch: int, n: int) -> dict[str, Any]:
    """Shuffled loaders with two workers (started each epoch, or kept: persistent), the rank
    seeded apart: per epoch, the seeds of the workers that loaded this rank's batches, with the
    batches; then the next numbers of the global stream."""
    torch.manual_seed(1000 + int(os.environ["RANK"]))
    out: dict[str, Any] = {}
    for persistent in (False, True):
        loader = DataLoader(WorkerSeeds(n), batch_size=batch, shuffle=True, num_workers=2,
                            persistent_workers=persistent)
        epochs = [[(ids.tolist(), seeds.tolist()) for ids, seeds in loader] for _ in range(2)]
        out["persistent" if persistent else "started"] = {
            "seeds": [sorted({s for _, seeds in epoch for s in seeds}) for epoch in epochs],
            "ids": [[ids for ids, _ in epoch] for epoch in epochs],
            "next": torch.rand(3).tolist()}
    return out


def generators(batch: int, n: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # the same script in one process: where DDP leaves each rank's own stream
    out["worker_seeds_alone"] = worker_seeds(batch, n)
    with distributed(timeout=scaled(TIMEOUT)):
        out["loaders"] = generator_sections(state().rank, batch, n)
        out["worker_seeds"] = worker_seeds(batch, n)
    out["python_random"] = _unreachable(
        lambda: DataLoader(LoggingDataset(n), batch_sampler=PythonRandomBatches(n, batch)))
    out["numpy"] = _unreachable(
        lambda: DataLoader(LoggingDataset(n), batch_size=batch, sampler=NumpySampler(n)))
    out["stream"] = _unreachable(lambda: DataLoader(ShuffledStream(n), batch_size=batch))
    return out


def _unreachable(make: Callable[[], DataLoader[Any]]) -> dict[str, Any]:
    """Ranks seeded differently, a sampler drawing from an RNG accel_ctx cannot reach."""
    out: dict[str, Any] = {"raised": None, "after": None}
    try:
        with distributed(timeout=scaled(TIMEOUT)):
            random.seed(state().rank)
            np.random.seed(state().rank)
            try:
                for _ in make():
                    pass
            except AccelCtxError as exc:
                out["raised"] = f"{type(exc).__name__}: {exc}"
                raise
            wait_for_everyone()  # rank 0 learns here that another rank stopped
    except AccelCtxError as exc:
        out["after"] = f"{type(exc).__name__}: {exc}"
    return out


# ---- point 11: even_batches=False with training --------------------------------------------------
def _train_uneven(loader: DataLoader[Any], epochs: int, gathered: list[Any] | None = None
                  ) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(epochs):
        for x, y in loader:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if gathered is not None:  # metrics gathered in the training loop
                gathered += gather_for_metrics(y).tolist()
    return params(model)


def _join_by_hand(per_epoch: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = MLP()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for batches in per_epoch:
        with Join([ddp]):
            for x, y in batches:
                F.cross_entropy(ddp(x), y).backward()
                opt.step()
                opt.zero_grad()
    return params(model)


def _references(per_epoch: list[Any], streamed: list[Any]) -> tuple[Any, Any]:
    return _join_by_hand(per_epoch), _join_by_hand(streamed)


def uneven(batch: int, n: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    data = make_data(n)
    # the reference: this rank's batches (r, r+W, ...) of the same shuffled epochs, drawn after
    # the same model initialisation, trained with DDP + Join written by hand
    torch.manual_seed(0)
    MLP()
    shuffled = DataLoader(data, batch_size=batch, shuffle=True)
    epochs = [list(shuffled)[rank::world] for _ in range(2)]
    streamed = [list(DataLoader(RowStream(n), batch_size=batch))[rank::world]]
    out["hand"], out["hand_stream"] = by_hand(_references, epochs, streamed)
    with distributed(timeout=scaled(TIMEOUT), even_batches=False):
        out["trained"] = _guard(
            lambda: _train_uneven(DataLoader(data, batch_size=batch, shuffle=True), 2))
        out["trained_stream"] = _guard(
            lambda: _train_uneven(DataLoader(RowStream(n), batch_size=batch), 1))
        # evaluation after training (the engines exist): no Join, nothing waits
        seen = torch.zeros(())
        with torch.no_grad():
            for x, _ in DataLoader(data, batch_size=batch):
                seen += x.shape[0]
        torch.distributed.all_reduce(seen)
        out["eval_seen"] = int(seen)
        # evaluation with gather_for_metrics: nothing padded, every sample once (on rank 0)
        ids: list[int] = []
        names: list[str] = []
        with torch.no_grad():
            for i, _ in DataLoader(LoggingDataset(n), batch_size=batch):
                ids += gather_for_metrics(i).tolist()
                names += gather_for_metrics([f"s{int(k)}" for k in i])
        out["gathered"], out["gathered_names"] = ids, names
        targets: list[int] = []
        torch.manual_seed(3)
        out["trained_gathering"] = _guard(lambda: _train_uneven(
            DataLoader(data, batch_size=batch, shuffle=True), 2, targets))
        out["trained_gathered"] = targets
    with distributed(timeout=scaled(TIMEOUT), even_batches=False), accumulate(2):
        out["accumulated"] = _guard(lambda: _train_uneven(DataLoader(data, batch_size=batch), 1))
        out["accumulated_steps"] = state().step
    # a fresh job whose first epoch is one whole round and a short one (W+1 batches of one,
    # Accelerate's join test): rank 0's second step must not wait for the ranks that left
    tiny = make_data(world + 1)
    out["one_round_hand"] = by_hand(_join_by_hand, [list(DataLoader(tiny))[rank::world]])
    out["one_round"] = _guard(lambda: _one_round(tiny))
    # too_few before two_models: the ranks meet again at the next scope's rendezvous, so rank 0
    # does not leave the job while the others still read its announcement from the store
    out["too_few"] = _too_few_batches(batch)
    out["two_models"] = _guard(lambda: _two_models(batch, n))
    return out


def _one_round(data: Any) -> dict[str, torch.Tensor]:
    with distributed(timeout=scaled(TIMEOUT), even_batches=False):
        return _train_uneven(DataLoader(data), 1)


def _two_models(batch: int, n: int) -> None:
    with distributed(timeout=scaled(TIMEOUT), even_batches=False):
        torch.manual_seed(0)
        a, b = nn.Linear(8, 3), nn.Linear(8, 3)
        for x, y in DataLoader(make_data(n), batch_size=batch):
            (F.cross_entropy(a(x), y) + F.cross_entropy(b(x), y)).backward()


def _too_few_batches(batch: int) -> dict[str, Any]:
    """Fewer batches than ranks: the rank with one cannot train it; it says so, nobody hangs."""
    out: dict[str, Any] = {"raised": None, "after": None}
    try:
        with distributed(timeout=scaled(TIMEOUT), even_batches=False):
            model = MLP()
            try:
                for x, y in DataLoader(make_data(batch), batch_size=batch):
                    F.cross_entropy(model(x), y).backward()
            except AccelCtxError as exc:
                out["raised"] = f"{type(exc).__name__}: {exc}"
                raise
            wait_for_everyone()
    except AccelCtxError as exc:
        out["after"] = f"{type(exc).__name__}: {exc}"
    return out


def run_all(batch: int, n_drop: int, n_gen: int, n_uneven: int) -> dict[str, Any]:
    return {
        "drop_last": _guard(lambda: drop_last(batch, n_drop)),
        "generators": _guard(lambda: generators(batch, n_gen)),
        "uneven": _guard(lambda: uneven(batch, n_uneven)),
    }
