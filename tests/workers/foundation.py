"""Checks of the foundation run inside each spawned rank (many per spawn: starting is slow)."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, RandomSampler

from accel_ctx import distributed, no_sync, on_main_process, state
from accel_ctx._engines import records as _records
from accel_ctx.errors import ConfigurationError, DistributedError

from .common import (
    MLP,
    ChunkBatchSampler,
    LoggingDataset,
    Stream,
    make_data,
    own_init_method,
    params,
    train,
)


def equivalence(batch_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with distributed():
        out["mlp"] = params(train("mlp", batch_size))
        out["conv"] = params(train("conv", batch_size))
        out["mlp_workers"] = params(train("mlp", batch_size, epochs=1, num_workers=2))
    return out


def identity_and_models() -> dict[str, Any]:
    out: dict[str, Any] = {}
    with distributed():
        torch.manual_seed(0)
        model = MLP()
        before = (id(model), type(model), sorted(model.state_dict()), model.save_pretrained())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = make_data()
        loader = DataLoader(data, batch_size=8, shuffle=True)
        for x, y in loader:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        out["same_object"] = before[0] == id(model) and type(model) is before[1]
        out["class_name"] = type(model).__name__
        out["keys_same"] = sorted(model.state_dict()) == before[2]
        out["no_module_prefix"] = not any(k.startswith("module.") for k in model.state_dict())
        out["helper"] = model.save_pretrained() == before[3]
        out["greeting"] = model.greeting
        out["engine"] = type(_records.module_record(model).engine).__name__  # type: ignore[union-attr]

        # GAN: two models, each with its own optimizer; plus a frozen helper model
        torch.manual_seed(1 + state().rank)  # different init per rank: adoption must sync it
        gen, disc = nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 1))
        frozen = nn.Linear(8, 8).requires_grad_(False)
        og = torch.optim.SGD(gen.parameters(), lr=0.05)
        od = torch.optim.SGD(disc.parameters(), lr=0.05)
        for step in range(3):
            torch.manual_seed(100 * step + state().rank)  # different data per rank
            z, real = torch.randn(6, 4), torch.randn(6, 8)
            d_loss = disc(real).mean() - disc(gen(z).detach()).mean()
            d_loss.backward()
            od.step()
            od.zero_grad()
            g_loss = -disc(frozen(gen(z))).mean()
            g_loss.backward()
            og.step()
            og.zero_grad()
            od.zero_grad()
        out["gan"] = params(gen), params(disc)
        out["frozen_engine"] = bool(_records.module_record(frozen).engine)  # type: ignore[union-attr]
        out["frozen"] = params(frozen)
        out["len_loader"] = len(loader)
    # after the scope: no DDP, no record; backward outside does not synchronise
    out["record_after"] = _records.module_record(model) is not None
    torch.manual_seed(int(os.environ["RANK"]) + 7)  # outside the scope state() says rank 0
    model.zero_grad()
    F.cross_entropy(model(torch.randn(4, 8)), torch.tensor([0, 1, 2, 0])).backward()
    out["grad_after"] = model.net[0].weight.grad.clone()  # type: ignore[union-attr]
    return out


def sequential_scopes(batch_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with distributed():
        model = train("mlp", batch_size, epochs=1)
    with distributed():  # evaluate in a second scope: a fresh process group
        data = make_data()
        correct = torch.zeros(())
        with torch.no_grad():
            for x, y in DataLoader(data, batch_size=batch_size):
                correct += (model(x).argmax(-1) == y).sum()
        dist.all_reduce(correct)
        out["eval_correct"] = int(correct)
    sweep = []
    for lr in (0.01, 0.05, 0.1):
        with distributed():
            sweep.append(params(train("mlp", batch_size, epochs=1, lr=lr)))
    out["sweep"] = sweep
    out["pg_after"] = dist.is_initialized()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with distributed(sync_batchnorm=True):
            bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
            bn(torch.randn(8, 4)).sum().backward()
    out["syncbn_warned"] = any("SyncBatchNorm cannot run" in str(w.message) for w in caught)
    return out


def sharding() -> dict[str, Any]:
    out: dict[str, Any] = {}
    with distributed():
        world = state().world_size
        torch.manual_seed(3)
        ds = LoggingDataset(23)
        loader = DataLoader(ds, batch_size=4, sampler=RandomSampler(ds))
        out["random"] = [b[0].tolist() for b in loader]
        out["random_loaded"] = sorted(ds.loaded)
        out["random_len"] = len(loader)
        ds2 = LoggingDataset(17)
        loader2 = DataLoader(ds2, batch_sampler=ChunkBatchSampler(17))
        out["custom"] = [b[0].tolist() for b in loader2]
        out["custom_loaded"] = sorted(ds2.loaded)
        out["custom_len"] = len(loader2)
        stream = DataLoader(Stream(19), batch_size=3)
        out["stream"] = [b.tolist() for b in stream]
        exact = LoggingDataset(10)
        with distributed(even_batches=False):
            out["exact"] = [b[0].tolist() for b in DataLoader(exact, batch_size=3)]
        # shuffling: identical on all ranks, new each epoch
        loader3 = DataLoader(LoggingDataset(12), batch_size=1, shuffle=True)
        torch.manual_seed(1000 + state().rank)  # ranks disagree; the scope makes them agree
        out["epochs"] = [[int(b[0]) for b in loader3] for _ in range(2)]
        # worker processes that live across epochs, with pinned memory asked for
        persistent = DataLoader(LoggingDataset(14), batch_size=2, shuffle=True, num_workers=2,
                                persistent_workers=True, pin_memory=True)
        out["persistent"] = [[int(i) for b in persistent for i in b[0]] for _ in range(2)]
        out["world"] = world
    return out


class Checkpointed(nn.Module):
    """Activation checkpointing (torch.utils.checkpoint) around a block of the model."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(8, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, self.inp(x), use_reentrant=self.reentrant)  # type: ignore[no-any-return]


class Branchy(nn.Module):
    """A second layer used on odd steps only."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 2)
        self.b = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.a(x) + self.b(x) if use_b else self.a(x)  # type: ignore[no-any-return]


def rank_only_and_parts() -> dict[str, Any]:
    """Rank-only previews, parts of a model called alone, the user's own DDP and group."""
    out: dict[str, Any] = {}
    with distributed():
        torch.manual_seed(state().rank)  # different init per rank
        model = MLP()

        @on_main_process
        def preview() -> torch.Tensor:
            with torch.no_grad():  # a first call on rank 0 only: no collective, no hang
                return model(torch.ones(2, 8))

        preview()

        @on_main_process
        def shuffled_evaluation() -> str | None:  # its order would need every rank: refused
            try:
                for _ in DataLoader(LoggingDataset(6), batch_size=2, shuffle=True):
                    pass
            except DistributedError as exc:
                return str(exc)
            return None

        out["rank_only_shuffled"] = shuffled_evaluation()

        @on_main_process
        def evaluation() -> None:  # sees rank 0's share: said so, not "on each process"
            with torch.no_grad():
                for _, x in DataLoader(LoggingDataset(8), batch_size=2):
                    model(x.expand(-1, 8))  # x: (2, 1)

        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        F.cross_entropy(model(torch.randn(4, 8)), torch.tensor([0, 1, 2, 0])).backward()
        opt.step()
        out["after_preview"] = params(model)  # rank 0's weights everywhere, then one step
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            evaluation()
            next(iter(DataLoader(LoggingDataset(4), batch_size=2)))  # training goes on: judged
        out["rank_only_evaluation"] = [str(w.message) for w in caught]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for reentrant in (False, True):  # the blocks run again in the backward
                checkpointed = Checkpointed(reentrant)
                checkpointed(torch.randn(4, 8)).sum().backward()
        out["checkpoint_warnings"] = [str(w.message) for w in caught]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.net(torch.randn(4, 8)).sum().backward()  # a part, alone, with gradients
        out["part_warned"] = any("called on its own" in str(w.message) for w in caught)

        # the user's own DDP inside the scope: no_sync() pauses it, and only while open
        own = nn.parallel.DistributedDataParallel(nn.Linear(3, 1))
        with no_sync():
            own(torch.ones(2, 3)).sum().backward()
        out["own_flag_after_no_sync"] = own.require_backward_grad_sync
        own.zero_grad()
        own(torch.full((2, 3), float(state().rank + 1))).sum().backward()
        out["own_grad"] = own.module.weight.grad.clone()  # type: ignore[union-attr]
        del own

        # a layer the forward leaves out: DDP stops at the next step; the fix names our option
        branchy = Branchy()
        out["unused_error"] = None
        try:
            for step in range(2):
                branchy(torch.randn(4, 8), use_b=step % 2 == 1).sum().backward()
        except ConfigurationError as exc:
            out["unused_error"] = str(exc)
    # a group the user formed first: distributed() uses it and leaves it to them
    dist.init_process_group("gloo", init_method=own_init_method("own"),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    try:
        with distributed():
            s = state()
            out["own_group"] = (s.rank, s.local_rank, s.world_size, s.local_world_size)
        out["own_group_alive"] = dist.is_initialized()
        # Nothing above communicates: without a collective, a rank that finished connecting
        # could tear the group down while another still connects to it, which gloo reports
        # there as "Connection closed by peer" (seen with 3 ranks on a busy machine).
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return out


def run_all(batch_size: int) -> dict[str, Any]:
    return {
        "equivalence": equivalence(batch_size),
        "identity": identity_and_models(),
        "sequential": sequential_scopes(batch_size),
        "sharding": sharding(),
        "rank_only": rank_only_and_parts(),
    }
