"""Checks run inside each spawned rank for scripts moved from Accelerate, DDP and Fabric."""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any

import torch
from torch.utils.data import DataLoader

from accel_ctx import accumulate, distributed, get_logger, state


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def accelerate_logging() -> dict[str, Any]:
    """The logging lines of an Accelerate script (run_clm_no_trainer.py's and its kin's)."""
    handler = _ListHandler()
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


def hf_clm_schedule(keep_accelerate_arithmetic: bool) -> dict[str, Any]:
    """transformers' run_clm_no_trainer.py, moved by the Accelerate guide's table
    (`accelerator.num_processes` -> `state().world_size`, `accelerator.accumulate` ->
    `accumulate(k)`), with ``--max_train_steps`` given; the warnings it gets, and its last lr."""
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


def run_all() -> dict[str, Any]:
    return {"logging": accelerate_logging(),
            "schedule_kept": hf_clm_schedule(keep_accelerate_arithmetic=True),
            "schedule_dropped": hf_clm_schedule(keep_accelerate_arithmetic=False)}
