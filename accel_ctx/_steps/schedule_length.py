"""A learning-rate schedule planned for world_size times the steps the loop took: Accelerate's
arithmetic, kept by a script moved from it.

Accelerate steps a prepared scheduler once per process at every optimizer step, so the scripts
written for it (transformers' ``*_no_trainer.py``) size it as ``max_train_steps *
accelerator.num_processes`` (and the warmup as ``num_warmup_steps * num_processes``). Under
accel_ctx the scheduler steps once per optimizer step, as with plain DDP: kept, that arithmetic
makes the schedule ``W`` times too slow, without an error.

The check is made once per scheduler, as the outermost ``distributed()`` exits without an
exception: the planned length, read from the scheduler (transformers' ``LambdaLR`` holds a
``functools.partial`` with ``num_training_steps``; ``OneCycleLR.total_steps``,
``CosineAnnealingLR.T_max``, ``LinearLR`` and ``PolynomialLR``'s ``total_iters``), against the
steps it took (its ``last_epoch``: the loop's optimizer steps, a resumed run's earlier ones
included). Only there is the loop's length known for sure: a script's epochs are a plain
``range`` and its loop may break at ``max_train_steps``, so a check at the first epoch would have
to guess the number of epochs (and would warn on a right schedule for 2 epochs on 2 processes).
One process is never checked: a world of one matches every length.
"""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING, Any

from torch.optim import lr_scheduler

from .._warn import warn_user

if TYPE_CHECKING:
    from .._job.job import Job

WATCHED: weakref.WeakKeyDictionary[Job, weakref.WeakSet[Any]] = weakref.WeakKeyDictionary()
"""Per job (its root), the schedulers met stepping in it: checked at its end when their length
is known."""


def planned_length(scheduler: Any) -> int | None:
    """The number of steps ``scheduler`` was made for, where it holds one; else None."""
    if isinstance(scheduler, lr_scheduler.OneCycleLR):
        return _count(scheduler.total_steps)
    if isinstance(scheduler, lr_scheduler.CosineAnnealingLR):
        return _count(scheduler.T_max)
    if isinstance(scheduler, (lr_scheduler.LinearLR, lr_scheduler.PolynomialLR)):
        return _count(scheduler.total_iters)
    if isinstance(scheduler, lr_scheduler.LambdaLR):  # transformers' get_scheduler(...)
        lengths = {_count(fn.keywords.get("num_training_steps"))
                   for fn in scheduler.lr_lambdas if isinstance(fn, functools.partial)}
        return lengths.pop() if len(lengths) == 1 else None
    return None


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def watch(scheduler: Any, job: Job) -> None:
    """Note ``scheduler``, stepping in ``job`` (of several processes), for the check at its end."""
    root = job.root
    seen = WATCHED.setdefault(root, weakref.WeakSet())
    try:
        seen.add(scheduler)
    except TypeError:  # not weakly referable: never checked
        return
    if planned_length(scheduler) is not None:
        root.at_end.append(functools.partial(_check, weakref.ref(scheduler), job.world_size,
                                             job.rank))


def _check(ref: weakref.ref[Any], world: int, rank: int, exc: BaseException | None) -> None:
    scheduler = ref()
    if exc is not None or scheduler is None or rank != 0:
        return
    planned, steps = planned_length(scheduler), getattr(scheduler, "last_epoch", 0)
    if not isinstance(steps, int) or steps <= 0 or planned != world * steps:
        return
    warmup = ""
    if isinstance(scheduler, lr_scheduler.LambdaLR):
        warmups = {fn.keywords.get("num_warmup_steps") for fn in scheduler.lr_lambdas
                   if isinstance(fn, functools.partial)}
        if len(warmups) == 1 and isinstance(w := warmups.pop(), int) and w > 0:
            warmup = f", its warmup of {w} steps {world} times too long as well"
    warn_user(
        f"{type(scheduler).__name__} was planned for {planned} steps, {world} times the {steps} "
        f"optimizer steps this run took on {world} processes: the schedule ran {world} times "
        f"too slowly{warmup}. That is the arithmetic of a script written for Accelerate "
        "(`num_training_steps=max_train_steps * accelerator.num_processes`, `num_warmup_steps * "
        "accelerator.num_processes`), whose prepared scheduler steps once per process. "
        "accel_ctx's scheduler.step() runs once per optimizer step, as with plain DDP: drop "
        "the `* num_processes` (`* state().world_size`) from both. See docs/migrate-accelerate.md, "
        "'The learning-rate scheduler'.", UserWarning)
