"""Checks run inside each spawned rank for scripts moved from Accelerate, DDP and Fabric."""

from __future__ import annotations

import copy
import importlib.util
import logging
import math
import os
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, RandomSampler
from torch.utils.data.distributed import DistributedSampler

from accel_ctx import accumulate, distributed, gather, get_logger, state, wait_for_everyone
from accel_ctx.errors import CheckpointError

from .common import ListHandler


def accelerate_logging() -> dict[str, Any]:
    """The logging lines of an Accelerate script (run_clm_no_trainer.py's and its kin's)."""
    handler = ListHandler()
    base = logging.getLogger("migrated_from_accelerate")
    base.addHandler(handler)
    base.propagate = False
    try:
        with distributed():
            logger = get_logger("migrated_from_accelerate", log_level="INFO")
            logger.info("***** Running training *****")
            logger.info("every rank", main_process_only=False)
            logger.info("in order", main_process_only=False, in_order=True)
            logger.warning_once("once")
            logger.warning_once("once")
            everyone = get_logger("migrated_from_accelerate", main_process_only=False)
            everyone.debug("below the level")
            everyone.warning("everyone's logger")
            everyone.info("only the main one", main_process_only=True)
        return {
            "messages": [r.getMessage() for r in handler.records],
            "funcs": sorted({r.funcName for r in handler.records}),
        }
    finally:
        base.removeHandler(handler)


def hf_clm_schedule(keep_accelerate_arithmetic: bool) -> dict[str, Any] | None:
    """transformers' run_clm_no_trainer.py, moved by the Accelerate guide's table
    (`accelerator.num_processes` -> `state().world_size`, `accelerator.accumulate` ->
    `accumulate(k)`), with ``--max_train_steps`` given; the warnings it gets, and its last lr."""
    if importlib.util.find_spec("transformers") is None:
        return None  # the compat tier's environments: the tests say skipped
    from transformers import get_scheduler

    gradient_accumulation_steps, max_train_steps, num_warmup_steps = 2, 3, 1
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with distributed(), accumulate(gradient_accumulation_steps):
            model = torch.nn.Linear(4, 1)
            train_dataloader = DataLoader(torch.randn(32, 4), batch_size=4, shuffle=True)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            num_update_steps_per_epoch = math.ceil(
                len(train_dataloader) / gradient_accumulation_steps)
            world = state().world_size if keep_accelerate_arithmetic else 1
            lr_scheduler = get_scheduler(
                name="linear", optimizer=optimizer,
                num_warmup_steps=num_warmup_steps * world,
                num_training_steps=max_train_steps * world)
            num_train_epochs = math.ceil(max_train_steps / num_update_steps_per_epoch)
            completed_steps = 0
            for _epoch in range(num_train_epochs):
                model.train()
                for batch in train_dataloader:
                    loss = model(batch).pow(2).mean()
                    loss.backward()
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()
                    if state().sync_gradients:
                        completed_steps += 1
                    if completed_steps >= max_train_steps:
                        break
    return {"warnings": [str(w.message) for w in caught if "planned for" in str(w.message)],
            "lr": lr_scheduler.get_last_lr()[0], "steps": completed_steps}


def _net() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def ddp_checkpoint(tmp_dir: str) -> dict[str, Any]:
    """pytorch/examples' imagenet/main.py: the DDP version saves ``model.state_dict()`` of its
    DDP wrapper; the migrated version (no DDP) loads it into its model, adopted by a first step."""
    path = os.path.join(tmp_dir, "checkpoint.pth.tar")
    with distributed():
        wrapped = DistributedDataParallel(_net())
        if state().rank == 0:
            torch.save({"epoch": 1, "state_dict": wrapped.state_dict()}, path)
        saved = {k: v.clone() for k, v in wrapped.module.state_dict().items()}
        wait_for_everyone()
        model = _net()
        checkpoint = torch.load(path, weights_only=True)
        try:  # imagenet/main.py's --resume: loaded before the first forward
            model.load_state_dict(checkpoint["state_dict"])
            refused_first = ""
        except CheckpointError as exc:
            refused_first = str(exc)
        torch.nn.init.zeros_(model[0].weight)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        F.cross_entropy(model(torch.randn(4, 4)), torch.tensor([0, 1, 0, 1])).backward()
        opt.step()
        checkpoint = torch.load(path, weights_only=True)
        try:
            model.load_state_dict(checkpoint["state_dict"])
            refused = ""
        except CheckpointError as exc:
            refused = str(exc)
        copy.deepcopy(model)  # the hook pickles and copies with the model
        consume_prefix_in_state_dict_if_present(checkpoint["state_dict"], "module.")
        model.load_state_dict(checkpoint["state_dict"])
        loaded = all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
        model.load_state_dict(wrapped.module.state_dict(), strict=False)  # other loads: as torch's
    return {"refused_first": refused_first, "refused": refused, "loaded": loaded,
            "hooks_after": len(model._load_state_dict_pre_hooks)}


def fabric_gather() -> dict[str, Any]:
    """Fabric's image-classifier example: `test_loss = fabric.all_gather(test_loss).sum()`."""
    with distributed():
        test_loss = 0.25 * (state().rank + 1)
        as_row = gather(torch.tensor(test_loss)).sum().item()
        bare = gather(test_loss)
    return {"as_row": as_row, "bare": bare}


def accelerate_order() -> dict[str, Any]:
    """The Accelerate guide's recipe for Accelerate's order on several processes: the batches
    each rank gets, and those Accelerate's prepare() deals (its RandomSampler's own generator
    seeded from the global one at prepare, rank r taking batch r of every W)."""
    dataset = torch.arange(16.0)
    with distributed():
        torch.manual_seed(3)
        generator = None  # the guide's block, as it is there
        if state().world_size > 1:
            generator = torch.Generator()
            generator.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
        loader = DataLoader(dataset, batch_size=2,
                            sampler=RandomSampler(dataset, generator=generator))
        seen = [[x.tolist() for x in loader] for _epoch in range(2)]
        world, rank = state().world_size, state().rank
    torch.manual_seed(3)
    theirs = torch.Generator()
    theirs.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
    expected = []
    for _epoch in range(2):
        order = torch.tensor(list(RandomSampler(dataset, generator=theirs)), dtype=torch.float32)
        batches = order.split(2)
        expected.append([b.tolist() for b in batches[rank::world]])
    return {"seen": seen, "expected": expected}


def ddp_sampler_orders() -> dict[str, Any]:
    """What the DDP guide says of DistributedSampler, kept and dropped: the batches each rank
    gets over two epochs, and those the guide's description of each gives."""
    dataset, seed, size = torch.arange(18.0), 5, 2
    with distributed():
        world, rank = state().world_size, state().rank
        sampler = DistributedSampler(dataset, shuffle=True, seed=seed)
        kept = DataLoader(dataset, batch_size=size, sampler=sampler)
        seen_kept = []
        for epoch in range(2):
            sampler.set_epoch(epoch)
            seen_kept.append([x.tolist() for x in kept])
        torch.manual_seed(9)
        dropped = DataLoader(dataset, batch_size=size, shuffle=True)
        seen_dropped = [[x.tolist() for x in dropped] for _epoch in range(2)]
    expected_kept = []
    for epoch in range(2):
        order = torch.randperm(18, generator=torch.Generator().manual_seed(seed + epoch))
        padded = torch.cat([order, order[: -len(order) % world]])  # to a multiple of W
        expected_kept.append([b.tolist() for b in padded[rank::world].float().split(size)])
    torch.manual_seed(9)
    one_process = DataLoader(dataset, batch_size=size, shuffle=True)
    expected_dropped = []
    for _epoch in range(2):
        batches = [x.tolist() for x in one_process]
        batches += batches[: -len(batches) % world]  # a short last round: the first batches
        expected_dropped.append(batches[rank::world])
    return {"kept": seen_kept == expected_kept, "dropped": seen_dropped == expected_dropped,
            "differ": seen_kept != seen_dropped}


def run_all(tmp_dir: str) -> dict[str, Any]:
    return {"logging": accelerate_logging(), "ddp_checkpoint": ddp_checkpoint(tmp_dir),
            "fabric_gather": fabric_gather(), "accelerate_order": accelerate_order(),
            "ddp_sampler": ddp_sampler_orders(),
            "schedule_kept": hf_clm_schedule(keep_accelerate_arithmetic=True),
            "schedule_dropped": hf_clm_schedule(keep_accelerate_arithmetic=False)}
