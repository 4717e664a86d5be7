"""Issue 14's loop helpers on real ranks: set_epoch, loader positions, loop awareness, decisions.

One spawned run per world size; each section returns plain data the tests compare.
"""

from __future__ import annotations

import os
import random
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torch.utils.data.distributed import DistributedSampler

from accel_ctx import (
    PowerSGD,
    all_ranks,
    any_rank,
    distributed,
    load_loader_state,
    loader_state,
    skip_first_batches,
    split_between_processes,
    state,
    synchronize_rng_states,
)

from .._timeouts import scaled

TIMEOUT = 60.0  # seconds, scaled where used (tests/_timeouts.py: a busy machine)


class Squares(Dataset[int]):
    """A map-style Dataset that is not a list: split_between_processes gives a Subset."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> int:
        return i * i


class EpochStream(IterableDataset[int]):
    """A streaming dataset that reseeds its order with set_epoch, as streaming libraries do."""

    def __init__(self) -> None:
        self.epochs: list[int] = []
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.epochs.append(epoch)

    def __iter__(self) -> Any:
        order = torch.randperm(12, generator=torch.Generator().manual_seed(self.epoch))
        return iter(order.tolist())


def _ids(batches: list[torch.Tensor]) -> list[list[int]]:
    return [b.tolist() for b in batches]


def set_epoch() -> dict[str, Any]:
    out: dict[str, Any] = {}
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    data = list(range(24))
    with distributed(timeout=scaled(TIMEOUT)):
        # a user's own DistributedSampler: told each epoch, not sharded a second time
        sampler = DistributedSampler(data, shuffle=True, seed=5)
        loader = DataLoader(data, batch_size=3, sampler=sampler)
        out["auto"] = [_ids(list(loader)) for _ in range(3)]
        out["auto_epoch"] = sampler.epoch
        # by hand, as torch's examples do: the user's value wins, from epoch 5
        manual = DistributedSampler(data, shuffle=True, seed=5)
        loader = DataLoader(data, batch_size=3, sampler=manual)
        out["manual"] = []
        for epoch in range(5, 7):
            manual.set_epoch(epoch)
            out["manual"].append(_ids(list(loader)))
        stream = EpochStream()
        stream_loader = DataLoader(stream, batch_size=4)
        for _ in range(2):
            list(stream_loader)
        out["stream_epochs"] = stream.epochs
    # what torch's DistributedSampler gives this rank when told the epoch by hand
    expected = []
    for epoch in range(3):
        reference = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=5)
        reference.set_epoch(epoch)
        expected.append(_ids(list(DataLoader(data, batch_size=3, sampler=reference))))
    out["expected_auto"] = expected
    out["expected_manual"] = []
    for epoch in range(5, 7):
        reference = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=5)
        reference.set_epoch(epoch)
        out["expected_manual"].append(_ids(list(DataLoader(data, batch_size=3, sampler=reference))))
    return out


def positions() -> dict[str, Any]:
    """A run that stops after 2 batches and resumes from loader_state() sees what an
    uninterrupted run sees; skip_first_batches skips this rank's batches."""
    out: dict[str, Any] = {}
    data = list(range(40))

    def loader() -> DataLoader[int]:
        return DataLoader(data, batch_size=2, shuffle=True,
                          generator=torch.Generator().manual_seed(7))

    with distributed(timeout=scaled(TIMEOUT)):
        torch.manual_seed(11)
        whole = loader()
        out["whole"] = [_ids(list(whole)) for _ in range(2)]
        torch.manual_seed(11)
        first = loader()
        it = iter(first)
        out["before"] = _ids([next(it), next(it)])
        saved = loader_state(first)
        out["saved_consumed"] = saved["consumed"]
        torch.manual_seed(999)  # a new process: other random states
        resumed = loader()
        load_loader_state(resumed, saved)
        out["after"] = _ids(list(resumed))
        out["next_epoch"] = _ids(list(resumed))
        plain = DataLoader(data, batch_size=2)
        out["skipped"] = _ids(list(skip_first_batches(plain, 3)))
        out["unskipped"] = _ids(list(plain))  # once: the next epoch is whole again
    return out


def awareness() -> dict[str, Any]:
    out: dict[str, Any] = {"seen": []}
    with distributed(timeout=scaled(TIMEOUT)):
        loader = DataLoader(list(range(12)), batch_size=2)
        out["before"] = (state().loader, state().end_of_loader)
        for _ in loader:
            s = state()
            out["seen"].append((s.batch_index, s.end_of_loader, s.loader is loader))
        out["after"] = (state().loader, state().end_of_loader)
        stream_flags = []
        for _ in DataLoader(EpochStream(), batch_size=4):  # no len(): found by looking ahead
            stream_flags.append(state().end_of_loader)
        out["stream"] = stream_flags
    return out


def decisions() -> dict[str, Any]:
    out: dict[str, Any] = {}
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    with distributed(timeout=scaled(TIMEOUT)):
        out["any_last"] = any_rank(rank == world - 1)
        out["any_none"] = any_rank(False)
        out["all_true"] = all_ranks(torch.tensor(1.0))
        out["all_one"] = all_ranks(rank == 0)
        out["nan"] = any_rank(torch.isnan(torch.tensor(float("nan") if rank == 1 else 0.0)))
        # early stopping: every rank leaves the loop at the same step
        steps = 0
        for step in range(100):
            steps += 1
            if any_rank(step == 3 + rank):
                break
        out["stopped_after"] = steps
        try:
            any_rank(torch.ones(2))
        except ValueError as exc:
            out["bad_flag"] = str(exc)
        random.seed(rank)
        torch.manual_seed(rank)
        g = torch.Generator().manual_seed(100 + rank)
        synchronize_rng_states(["python", "torch"], [g])
        out["draws"] = (random.random(), torch.rand(2).tolist(), torch.rand(1, generator=g).item())
        out["squares"] = list(split_between_processes(Squares()))
        out["range"] = split_between_processes(range(7))
        out["padded_range"] = split_between_processes(range(7), pad=True)
        out["tuple"] = split_between_processes((1, 2, 3, 4, 5))
    return out


def run_all(folder: str) -> dict[str, Any]:
    return {"watch": watch(folder), "set_epoch": set_epoch(), "positions": positions(), "awareness": awareness(),
            "decisions": decisions(), "hooks": comm_hooks(), "batch_sizes": batch_sizes()}


# ---- DDP communication hooks -------------------------------------------------------------------
def _hook(spec: Any) -> tuple[Any, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if spec == "bf16":
        return None, default_hooks.bf16_compress_hook
    if spec == "fp16":
        return None, default_hooks.fp16_compress_hook
    if spec == "powersgd":
        return powerSGD_hook.PowerSGDState(process_group=None), powerSGD_hook.powerSGD_hook
    if spec == "powersgd-now":  # compressing from the second step on
        return (powerSGD_hook.PowerSGDState(process_group=None, start_powerSGD_iter=2),
                powerSGD_hook.powerSGD_hook)
    if spec == "powersgd-rank2":
        return (powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                            start_powerSGD_iter=2),
                powerSGD_hook.powerSGD_hook)
    return None, None


def _train_hooked(batches: list[Any], spec: Any, scoped: bool) -> dict[str, torch.Tensor]:
    import torch.nn.functional as F
    from torch import nn

    from .common import MLP, params

    torch.manual_seed(0)
    model = MLP()
    net: nn.Module = model
    if not scoped:
        net = nn.parallel.DistributedDataParallel(model)
        state_, hook = _hook(spec)
        if hook is not None:
            net.register_comm_hook(state_, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        F.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    return params(model)


def _train_two(batches: list[Any], how: str) -> list[dict[str, torch.Tensor]]:
    """Two models stepped together; ``how``: "scoped", "hand" (a PowerSGD state per model, as
    the scope must build them) or "shared" (one state for both: what the scope must not do)."""
    import torch.nn.functional as F
    from torch import nn

    from .common import MLP, params

    models, nets, opts = [], [], []
    shared = _hook("powersgd-rank2")
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = MLP()
        net: nn.Module = model
        if how != "scoped":
            net = nn.parallel.DistributedDataParallel(model)
            net.register_comm_hook(*(shared if how == "shared" else _hook("powersgd-rank2")))
        models.append(model)
        nets.append(net)
        opts.append(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for x, y in batches:
        for net, opt in zip(nets, opts, strict=True):
            F.cross_entropy(net(x), y).backward()
            opt.step()
            opt.zero_grad()
    return [params(m) for m in models]


def comm_hooks() -> dict[str, Any]:
    from .common import by_hand, make_data

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    data = make_data(48)
    mine = list(DataLoader(data, batch_size=4))[rank::world]
    out: dict[str, Any] = {}
    options = {"none": None, "powersgd-now": _hook("powersgd-now"),
               "powersgd-rank2": PowerSGD(rank=2, start_iter=2)}
    for spec in ("none", "fp16", "powersgd", "powersgd-now", "powersgd-rank2"):  # bf16: CUDA
        out[f"hand_{spec}"] = by_hand(_train_hooked, mine, spec, False)
        with distributed(timeout=scaled(TIMEOUT), comm_hook=options.get(spec, spec)):
            out[spec] = _train_hooked(list(DataLoader(data, batch_size=4)), spec, True)
    for how in ("hand", "shared"):
        out[f"two_{how}"] = by_hand(_train_two, mine, how)
    with distributed(timeout=scaled(TIMEOUT), comm_hook=PowerSGD(rank=2, start_iter=2)):
        out["two_scoped"] = _train_two(list(DataLoader(data, batch_size=4)), "scoped")
    try:
        with distributed(timeout=scaled(TIMEOUT), comm_hook="bf16"):
            pass
    except ValueError as exc:
        out["bf16_refused"] = str(exc)
    return out



# ---- find_executable_batch_size ----------------------------------------------------------------
class _Hungry(torch.nn.Module):
    """Runs out of memory (as CUDA says it) in forward above ``limit`` rows."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.fc = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.fc(x)


def batch_sizes() -> dict[str, Any]:
    import time

    import torch.nn.functional as F

    from accel_ctx import find_executable_batch_size, reduce
    from accel_ctx.errors import DistributedError

    from .common import make_data

    rank, _world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out: dict[str, Any] = {"tried": [], "trained_tried": []}
    with distributed(timeout=scaled(TIMEOUT)):
        @find_executable_batch_size(starting_batch_size=64)
        def probe(batch_size: int) -> int:
            out["tried"].append(batch_size)
            reduce(torch.ones(1))  # collectives before the allocation that fails are fine
            if batch_size > 32 // (rank + 1):  # each rank fits a different size
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return batch_size

        out["probe"] = probe()

        @find_executable_batch_size(starting_batch_size=64)
        def train(batch_size: int) -> float:
            out["trained_tried"].append(batch_size)
            torch.manual_seed(0)
            model = _Hungry(limit=16)  # the same on every rank: they run out together
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            loss = torch.zeros(())
            for x, y in DataLoader(make_data(96), batch_size=batch_size):
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
            return float(reduce(loss.detach(), "mean"))

        out["trained"] = train()
    start = time.monotonic()
    try:
        with distributed(timeout=scaled(TIMEOUT)):
            @find_executable_batch_size(starting_batch_size=32)
            def lopsided(batch_size: int) -> None:
                model = _Hungry(limit=8 if rank == 1 else 64)  # rank 1 runs out alone
                for x, y in DataLoader(make_data(64), batch_size=batch_size):
                    F.cross_entropy(model(x), y).backward()

            lopsided()
    except DistributedError as exc:
        out["lopsided"] = str(exc)
    out["lopsided_seconds"] = time.monotonic() - start
    return out


# ---- progress and metrics ----------------------------------------------------------------------
def watch(folder: str) -> dict[str, Any]:
    import contextlib
    import io

    from accel_ctx import log_metrics, progress, reduce

    out: dict[str, Any] = {}
    with distributed(timeout=scaled(TIMEOUT)):
        loader = DataLoader(list(range(12)), batch_size=2)
        drawn = io.StringIO()
        with contextlib.redirect_stderr(drawn):
            out["items"] = [b.tolist() for b in progress(loader, desc="train", mininterval=0)]
        out["drawn"] = drawn.getvalue()
        for step in range(3):
            loss = reduce(torch.tensor(float(step)), "mean")
            log_metrics({"loss": loss, "lr": 0.1}, step=step, directory=folder)
    return out
