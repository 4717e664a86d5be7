"""Evaluation loops over a sharded loader that count only their own share: warned, never silent.

Wrapping a script's ``main()`` shards its test loader too: each rank evaluates ``1/W`` of the
samples, and a loop that sums its own loss and correct counts prints "Accuracy: 1000/2000
(50%)" for a perfect model. With ``even_batches`` (the default) the last round is padded with
repeated batches, so counts summed over the ranks with ``reduce`` are too high instead.

A *pass* is one ``iter(loader)`` of a loader accel_ctx shards over several ranks. A pass that
ran to its end without a backward in it, iterated with gradients off or with a model called
without them inside, is an evaluation. Whether its results met the other
ranks is read from the process group's collective count (every ``gather_for_metrics``,
``gather``, ``reduce``, ``dist.all_reduce`` ... moves it): taken when the pass starts and ends,
and read again when training goes on (a backward, a training loop's ``iter()``) or the job
ends. Nothing since the pass started: rank 0 warns once per loader that its numbers describe
this rank's share. Padding repeated in the pass but results combined without
``gather_for_metrics`` (which drops the repeats): rank 0 warns once that sums count them twice.
All of it happens at a pass's start and end and at the verdict, never per batch.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .._distributed.job import Job
from .._warn import warn_user
from .shard import ShardPlan


def collectives_so_far() -> int | None:
    """Collectives this process has run on the default group (None: not countable)."""
    if not dist.is_initialized():
        return None
    try:
        group = dist.distributed_c10d._get_default_group()
        count = getattr(group, "_get_sequence_number_for_group", None)
        return int(count()) if count is not None else None
    except RuntimeError:
        return None


@dataclass
class EvalPass:
    """One evaluation pass of a sharded loader, waiting for the verdict."""

    loader: weakref.ref[Any]
    where: str  # the user's line of the loop
    plan: ShardPlan
    total: int | None  # global batches in the epoch
    collectives_at_start: int
    metric_gathers: int  # gather_for_metrics calls during the pass


def pass_ended(job: Job, loader: Any, where: str, plan: ShardPlan, total: int | None,
               collectives_at_start: int | None, metric_gathers: int) -> None:
    """An evaluation pass of ``loader`` ran to its end: keep it for the verdict."""
    root = job.root
    verdict(root)  # an earlier pass is judged first
    if plan.world == 1 or collectives_at_start is None or loader in root.eval_warned:
        return
    root.pending_eval = EvalPass(weakref.ref(loader), where, plan, total,
                                 collectives_at_start, metric_gathers)


def verdict(job: Job) -> None:
    """Training goes on, or the job ends: warn about the pending evaluation pass, if it needs it."""
    root = job.root
    pending = root.pending_eval
    if pending is None:
        return
    root.pending_eval = None
    loader = pending.loader()
    now = collectives_so_far()
    if loader is None or now is None or job.rank != 0:
        return
    padded = _padded_batches(pending.plan, pending.total)
    if now == pending.collectives_at_start:
        root.eval_warned.add(loader)
        warn_user(_never_combined(loader, pending, padded), RuntimeWarning)
    elif padded and pending.metric_gathers == 0:
        root.eval_warned.add(loader)
        warn_user(_padding_counted(loader, pending, padded), RuntimeWarning)


def _padded_batches(plan: ShardPlan, total: int | None) -> int:
    """Batches repeated to even out the epoch's last round (on the last ranks)."""
    if total is None or plan.drop or not plan.even:
        return 0
    remaining = max(total - plan.skip, 0)
    return -remaining % plan.world if remaining else 0


def _describe(loader: Any, pending: EvalPass) -> str:
    dataset = getattr(loader, "dataset", None)
    name = type(dataset).__name__ if dataset is not None else "data"
    try:
        samples = f"{len(dataset)} samples"  # type: ignore[arg-type]
    except TypeError:
        samples = "samples"
    size = getattr(loader, "batch_size", None)
    batches = f" in batches of {size}" if size else ""
    where = f", the loop at {pending.where}" if pending.where else ""
    return f"the DataLoader over {name} ({samples}{batches}{where})"


def _shares(loader: Any, pending: EvalPass) -> str:
    """'rank 0: 1000 samples, rank 1: 1000' (batches when sample counts are unknown)."""
    plan, total = pending.plan, pending.total
    if total is None:
        return "each rank its own batches"
    world = plan.world
    size = getattr(loader, "batch_size", None)
    try:
        n: int | None = len(loader.dataset)
    except TypeError:
        n = None

    def samples(batch: int) -> int:  # the epoch's last batch may be short
        assert isinstance(size, int) and n is not None
        return n - size * (total - 1) if batch == total - 1 else size

    parts = []
    remaining = max(total - plan.skip, 0)
    for rank in range(world):
        batches = ShardPlan(rank, world, plan.even, plan.skip, plan.drop).share(total)
        if size and n is not None:
            # a range, not a list: a sampler may be of any length (num_samples=int(1e10))
            real = range(plan.skip + rank, total, world)[:batches]
            count = size * len(real) + (samples(total - 1) - size if total - 1 in real else 0)
            if len(real) < batches and remaining:  # padding: a batch of the first round again
                first_round = min(world, remaining)
                count += samples(plan.skip + (rank - remaining % world) % first_round)
            parts.append(f"rank {rank}: {count} samples")
        else:
            parts.append(f"rank {rank}: {batches} batches")
    return ", ".join(parts)


def _never_combined(loader: Any, pending: EvalPass, padded: int) -> str:
    world = pending.plan.world
    repeat = (f" (the last round repeated {padded} batch{'es' if padded > 1 else ''} so that "
              "every rank has as many)") if padded else ""
    return (
        f"an evaluation over {_describe(loader, pending)} ran without gradients on each of the "
        f"{world} processes with its own share of the samples ({_shares(loader, pending)})"
        f"{repeat}, and nothing combined its results across the ranks: sums, counts and "
        "averages computed from this loop describe the samples this rank saw, not the data "
        "set. Fix: gather each batch's outputs with "
        "gather_for_metrics(...) (every sample exactly once), or, with "
        "distributed(even_batches=False), sum your counts across ranks with reduce(...) after "
        "the loop; to evaluate everything on every rank instead, run the loop outside "
        "distributed()."
    )


def _padding_counted(loader: Any, pending: EvalPass, padded: int) -> str:
    size = getattr(loader, "batch_size", None)
    samples = f" ({padded * size} samples)" if size else ""
    return (
        f"an evaluation over {_describe(loader, pending)} was combined across the ranks, but "
        f"its last round repeated {padded} batch{'es' if padded > 1 else ''}{samples} from the "
        "epoch's start so that every rank has as many (distributed(even_batches=True), the "
        "default): counts and sums reduced over the ranks include them twice. Fix: gather each "
        "batch's outputs with gather_for_metrics(...), which drops the repeats, or use "
        "distributed(even_batches=False) (nothing repeated: reduce(...) then sums each sample "
        "once)."
    )
