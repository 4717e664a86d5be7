"""Evaluation loops over a sharded loader that count only their own share: warned, never silent.

Wrapping a script's ``main()`` shards its test loader too: each rank evaluates ``1/W`` of the
samples, and a loop that sums its own loss and correct counts prints "Accuracy: 1000/2000
(50%)" for a perfect model. With ``even_batches`` (the default) the last round is padded with
repeated batches, so counts summed over the ranks with ``reduce`` are too high instead.

A *pass* is one ``iter(loader)`` of a loader accel_ctx shards over several ranks. A pass that
ran to its end without a backward in it, iterated with gradients off or with a model called
without them inside, is an evaluation. Whether its results met the other ranks is read from
the collective counts of the process groups (every ``gather_for_metrics``, ``gather``,
``reduce``, ``dist.all_reduce`` ... on the default group or a user's own ``new_group`` moves
them; the engines' own meshes do not count) and from ``wait_for_everyone()`` calls (a script
that writes each rank's results to its own file needs one before it reads them together):
taken when the pass starts and ends, and read again when training goes on (a backward, a
training loop's ``iter()``) or the job ends without an exception (the evaluation was its last
loop). Nothing since the pass started: rank 0 warns once per loader that its numbers describe
this rank's share. Padding repeated in the pass but results combined without
``gather_for_metrics`` (which drops the repeats): rank 0 warns once that sums count them twice.
What the warning says of the loader is kept at the pass's end, not the loader: one made inline
or local to ``main()`` is gone by the verdict. The verdict reads only this rank's counts, so the
job's end judges without waiting for any other rank. All of it happens at a pass's start and
end and at the verdict, never per batch.

A loop that writes each rank's results into a file of its own (predictions per rank, merged
later or elsewhere) combined them as it should: a file open for writing at the pass's start that
grew by the verdict (``_data.file_writes``) counts as its results leaving the rank, and nothing
is said. Only a pass begun without gradients (``with torch.no_grad():`` around the loop) is
looked at so. Where that is not seen (a file opened and written after the loop, a loop that turns
gradients off inside each batch), the warning says how to tell the two apart.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .._job.job import Job
from .._kernel import state as _state
from .._ranks.watch import metrics_folders
from .._warn import warn_user
from . import file_writes as _file_writes
from .shard import ShardPlan

_grad_enabled = torch.is_grad_enabled
# the file writes at the latest pass start of each job (read when that pass ends)
_writes_at_start: weakref.WeakKeyDictionary[Job, _file_writes.Writes] = (
    weakref.WeakKeyDictionary())


def collectives_so_far(job: Job) -> int | None:
    """At a pass's start: the times this process's results could have met the other ranks' so
    far (None: not countable), and the files this thread wrote so far, kept for the pass."""
    if not _grad_enabled() and dist.is_initialized():
        # only a pass begun without gradients (an inference or evaluation): reading /proc at
        # every training epoch's start (or every next(iter(loader))) would tax the steps
        _writes_at_start[job.root] = _file_writes.now(_store_file(job), metrics_folders())
    else:
        _writes_at_start.pop(job.root, None)
    return _collectives(job)


def _store_file(job: Job) -> str | None:
    method = job.root.launch.init_method
    return method.removeprefix("file://") if method and method.startswith("file://") else None


def _collectives(job: Job) -> int | None:
    """Collectives on any process group but the engines' own meshes (a user's ``new_group``
    counts), and ``wait_for_everyone()`` calls (the sync a script needs before reading the
    files other ranks wrote)."""
    if not dist.is_initialized():
        return None
    try:
        default = dist.distributed_c10d._get_default_group()
        engines = {id(g) for g in job.mesh_groups()} - {id(default)}
        total = job.root.waits
        for group in list(dist.distributed_c10d._world.pg_map):
            if id(group) in engines:
                continue  # an engine's all-gathers in a sharded forward combine no results
            count = getattr(group, "_get_sequence_number_for_group", None)
            if count is None and group is default:
                return None
            total += int(count()) if count is not None else 0
        return total
    except RuntimeError:
        return None


@dataclass(frozen=True)
class Loader:
    """What the warning says of a loader, kept instead of the loader: a loader made inline or
    local to a function is gone by the time the verdict is due (the job's end, often)."""

    dataset: str  # its class name
    samples: int | None  # len(dataset)
    batch_size: int | None

    @classmethod
    def of(cls, loader: Any) -> Loader:
        dataset = getattr(loader, "dataset", None)
        try:
            samples: int | None = len(dataset)  # type: ignore[arg-type]
        except (TypeError, NotImplementedError):
            samples = None
        size = getattr(loader, "batch_size", None)
        return cls(type(dataset).__name__ if dataset is not None else "data", samples,
                   size if isinstance(size, int) else None)


@dataclass
class EvalPass:
    """One evaluation pass of a sharded loader, waiting for the verdict."""

    loader: weakref.ref[Any]  # only to say each loader once: the words come from ``facts``
    facts: Loader
    where: str  # the user's line of the loop
    plan: ShardPlan
    total: int | None  # global batches in the epoch
    collectives_at_start: int
    metric_gathers: int  # gather_for_metrics calls during the pass
    writes_at_start: _file_writes.Writes | None = None  # the thread's file writes at its start
    rank_only: _state.RankOnly | None = None  # the pass ran in rank-only code (on_main_process)


def pass_ended(job: Job, loader: Any, where: str, plan: ShardPlan, total: int | None,
               collectives_at_start: int | None, metric_gathers: int) -> None:
    """An evaluation pass of ``loader`` ran to its end: keep it for the verdict."""
    root = job.root
    verdict(root)  # an earlier pass is judged first
    if plan.world == 1 or collectives_at_start is None or loader in root.eval_warned:
        return
    root.pending_eval = EvalPass(weakref.ref(loader), Loader.of(loader), where, plan, total,
                                 collectives_at_start, metric_gathers,
                                 writes_at_start=_writes_at_start.get(root),
                                 rank_only=_state.rank_only())


def verdict(job: Job) -> None:
    """Training goes on, or the job ends: warn about the pending evaluation pass, if it needs it.

    Local to each rank (its own collective count; rank 0 speaks), so the job's end may judge
    too without waiting for any other rank."""
    root = job.root
    pending = root.pending_eval
    if pending is None:
        return
    root.pending_eval = None
    now = _collectives(job)
    if now is None or job.rank != 0:
        return
    padded = _padded_batches(pending.plan, pending.total)
    if now == pending.collectives_at_start:
        start = pending.writes_at_start
        if (pending.rank_only is None and start is not None
                and _file_writes.wrote_files(start)):
            return  # each rank wrote its results to files of its own: nothing to combine here
        text = _never_combined(pending, padded)
    elif padded and pending.metric_gathers == 0:
        text = _padding_counted(pending, padded)
    else:
        return
    loader = pending.loader()
    if loader is not None:
        root.eval_warned.add(loader)
    warn_user(text, RuntimeWarning)


def drop(job: Job) -> None:
    """The job ends by an exception: no verdict on a pass that may not have been its last."""
    job.root.pending_eval = None


def _padded_batches(plan: ShardPlan, total: int | None) -> int:
    """Batches repeated to even out the epoch's last round (on the last ranks)."""
    if total is None or plan.drop or not plan.even:
        return 0
    remaining = max(total - plan.skip, 0)
    return -remaining % plan.world if remaining else 0


def _describe(pending: EvalPass) -> str:
    facts = pending.facts
    samples = f"{facts.samples} samples" if facts.samples is not None else "samples"
    batches = f" in batches of {facts.batch_size}" if facts.batch_size else ""
    where = f", the loop at {pending.where}" if pending.where else ""
    return f"the DataLoader over {facts.dataset} ({samples}{batches}{where})"


def _shares(pending: EvalPass) -> str:
    """'rank 0: 1000 samples, rank 1: 1000' (batches when sample counts are unknown)."""
    if pending.total is None:
        return "each rank its own batches"
    return ", ".join(_rank_shares(pending, pending.total))


def _rank_shares(pending: EvalPass, total: int) -> list[str]:
    """Per rank, 'rank R: N samples' (or 'rank R: N batches')."""
    plan = pending.plan
    world = plan.world
    size, n = pending.facts.batch_size, pending.facts.samples

    def samples(batch: int) -> int:  # the epoch's last batch may be short
        assert size is not None and n is not None
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
    return parts


def _never_combined(pending: EvalPass, padded: int) -> str:
    world = pending.plan.world
    if pending.rank_only is not None:  # the other ranks never ran it: their shares are unseen
        mark = pending.rank_only
        mine = _shares(pending) if pending.total is None else _rank_shares(
            pending, pending.total)[0]
        return (
            f"an evaluation over {_describe(pending)} ran without gradients inside "
            f"{mark.label}: {mark.who}, and it saw only this rank's share of the samples "
            f"({mine}): "
            f"inside distributed() every DataLoader is sharded over the {world} processes, so "
            "sums, counts and averages computed from this loop describe 1/"
            f"{world} of the data set. Fix: run the evaluation on every rank, outside "
            f"{mark.label}, gathering each batch's outputs with gather_for_metrics(...) (every "
            "sample exactly once), then report on rank 0; or evaluate after the distributed() "
            "block, where the loader is whole."
        )
    repeat = (f" (the last round repeated {padded} batch{'es' if padded > 1 else ''} so that "
              "every rank has as many)") if padded else ""
    return (
        f"an evaluation over {_describe(pending)} ran without gradients on each of the "
        f"{world} processes with its own share of the samples ({_shares(pending)})"
        f"{repeat}, and nothing combined its results across the ranks: sums, counts and "
        "averages computed from this loop describe the samples this rank saw, not the data "
        "set. Fix: gather each batch's outputs with "
        "gather_for_metrics(...) (every sample exactly once), or, with "
        "distributed(even_batches=False), sum your counts across ranks with reduce(...) after "
        "the loop; to evaluate everything on every rank instead, run the loop outside "
        "distributed(). (A loop that writes each rank's results to a file of its own is right "
        "as it is, and is not warned about where its writes are seen; call "
        "wait_for_everyone() after writing them, before reading the files together, which "
        "also tells accel_ctx they meet.)"
    )


def _padding_counted(pending: EvalPass, padded: int) -> str:
    size = pending.facts.batch_size
    samples = f" ({padded * size} samples)" if size else ""
    return (
        f"an evaluation over {_describe(pending)} was combined across the ranks, but "
        f"its last round repeated {padded} batch{'es' if padded > 1 else ''}{samples} from the "
        "epoch's start so that every rank has as many (distributed(even_batches=True), the "
        "default): counts and sums reduced over the ranks include them twice. Fix: gather each "
        "batch's outputs with gather_for_metrics(...), which drops the repeats, or use "
        "distributed(even_batches=False) (nothing repeated: reduce(...) then sums each sample "
        "once)."
    )


def last_verdict(job: Job) -> Callable[..., bool]:
    """The verdict on an evaluation that was the job's last loop (``_data.eval_passes``), when
    the scope exits normally: local to each rank, it needs no other rank. Leaving by an
    exception, the loop may not have been meant as the last: nothing said."""

    def judge(exc_type: type[BaseException] | None, exc: BaseException | None,
              tb: object) -> bool:
        if exc is None:
            verdict(job)
        else:
            drop(job)
        return False

    return judge
