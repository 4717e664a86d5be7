"""``local_sgd()``'s checks of its use: a job of several processes with nothing to average them,
an outer optimizer of the wrong shape, and ranks that reach a synchronisation at different steps.

Each check is made where the mistake can first be seen and ends the job at once with a message
naming the cause and the fix: otherwise the ranks would end apart with exit code 0, fail with a
bare ``TypeError`` deep inside the first step, or average models of different points and hang in
the next collective (600 s later, blamed on it).
"""

from __future__ import annotations

import inspect
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from .._group import blame as _blame
from .._job import env as _env
from .._job.job import Job
from .._kernel import state as _state
from ..errors import ArgumentError, ConfigurationError, DistributedError, LaunchEnvironmentError

__all__ = ["check_outer_optimizer", "check_steps", "refuse_alone"]

_EXAMPLE = "functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)"


def check_outer_optimizer(outer: Any) -> None:
    """Refuse an ``outer_optimizer`` that cannot be called with the parameters alone: the scope
    calls ``outer_optimizer(params)`` once, with the list of its float32 global parameters.

    >>> check_outer_optimizer(lambda params: torch.optim.SGD(params, lr=0.7))
    >>> try:
    ...     check_outer_optimizer(lambda params, lr: None)
    ... except TypeError as e:
    ...     print(type(e).__name__, "|", str(e).split(" (")[0])
    ArgumentError | local_sgd(outer_optimizer=<lambda>(params, lr)) cannot be called as outer_optimizer(params)
    """
    try:
        signature = inspect.signature(outer)
    except (TypeError, ValueError):  # a builtin without a signature: its call will tell
        return
    try:
        signature.bind([])
    except TypeError as exc:
        name = getattr(outer, "__name__", type(outer).__name__)
        raise ArgumentError(
            f"local_sgd(outer_optimizer={name}{signature}) cannot be called as "
            f"outer_optimizer(params) ({exc}): it must be a function of one argument, the list "
            "of parameters the outer optimizer steps (the scope's float32 copy of the "
            "synchronised weights), that returns a torch.optim.Optimizer over them. Bind every "
            f"other argument beforehand, e.g. {_EXAMPLE}, or "
            "lambda params: torch.optim.SGD(params, lr=0.7).") from None


def _processes() -> tuple[int, str]:
    """How many processes this one's job was started with, and who says so ("" for one)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_world_size(), "a process group of your own"
    try:
        launch = _env.detect()
    except LaunchEnvironmentError:
        return 1, ""  # distributed() names a broken environment when it opens
    if launch.lighthouse:
        return launch.replica_groups, (f"replica group {launch.replica_group} of "
                                       f"{launch.replica_groups}, accel-ctx launch --replica-groups")
    if launch.is_distributed:
        return launch.coordinates.world_size, f"WORLD_SIZE={launch.coordinates.world_size}"
    return 1, ""


def refuse_alone(stack: _state.Stack | None, every: int) -> None:
    """Refuse a ``local_sgd()`` open with no ``distributed()`` in a job of several processes:
    nothing would average the ranks' models (each would train its own, and exit 0)."""
    if stack is None or stack.job is not None:
        return
    count, why = _processes()
    if count > 1:
        raise ConfigurationError(
            f"local_sgd(every={every}) is open without distributed(), in a job of {count} "
            f"processes ({why}): nothing would average their models, and each would train "
            f"its own and end with it. Open distributed() around it: `with distributed(), "
            f"local_sgd(every={every}):`.")


def check_steps(job: Job, steps: int, passes: int, every: int, what: str, final: bool) -> None:
    """One small all-gather at a synchronisation: every rank's optimizer steps and backward
    passes in the scope, which must be the same on every rank (one rank's ``opt.step()``
    skipped, or one more, would pair this synchronisation with another rank's next one)."""
    if job.world_size < 2:
        return
    mine = torch.tensor([steps, passes], dtype=torch.int64, device=job.comm_device(
        torch.device("cpu")))
    rows = [torch.empty_like(mine) for _ in range(job.world_size)]
    try:
        dist.all_gather(rows, mine)
    except Exception as exc:
        _blame.reraise(job, exc, f"local_sgd()'s synchronisation ({what})")
        raise
    table = [(int(r[0]), int(r[1])) for r in rows]
    if len(set(table)) > 1:
        raise DistributedError(_mismatch(table, every, what, final))


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _mismatch(table: list[tuple[int, int]], every: int, what: str, final: bool) -> str:
    """The rank(s) off, by how many steps, against the count most ranks agree on (rank 0's on a
    tie)."""
    common = Counter(table).most_common()
    top = common[0][1]
    reference = next(row for row in table if Counter(table)[row] == top)
    ref_rank = table.index(reference)
    ref_steps, ref_passes = reference
    per_step = ref_passes / ref_steps if ref_steps else 1.0
    parts = []
    for rank, (steps, passes) in enumerate(table):
        if (steps, passes) == reference:
            continue
        off = ref_steps - steps if steps != ref_steps else round((passes - ref_passes) / per_step)
        off = off or (1 if passes > ref_passes else -1)
        side = "fewer" if off > 0 else "more"
        parts.append(f"rank {rank} took {abs(off)} optimizer step{'s' if abs(off) != 1 else ''} "
                     f"{side} than rank {ref_rank} ({steps} steps in {passes} backward passes; "
                     f"rank {ref_rank}: {ref_steps} in {ref_passes})")
    where = ("at the end of the scope" if final
             else f"at the {_ordinal(ref_steps // every)} synchronisation")
    return (f"local_sgd(every={every}), {what}: the ranks are not at the same step {where}: "
            f"{'; '.join(parts)}. Every rank must call opt.step() after the same backward passes "
            "(a step skipped on one rank, e.g. under an `if` on a value of its own, pairs each "
            "later synchronisation with another rank's next one); the job ends here rather than "
            "average models taken at different steps.")
