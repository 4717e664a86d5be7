"""Pipeline parallelism's options (``pp=``, ``microbatches=``), checked where they are given.

Examples:
    >>> from accel_ctx._job.stages import pipeline_options
    >>> pipeline_options({"pp": 2}, "distributed")
    {'pp': 2, 'microbatches': 2, 'schedule': 'gpipe', 'loss_fn': None}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ConfigurationError

SCHEDULES = ("gpipe", "1f1b")


def _count(call: str, name: str, value: object, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(
            f"{call}({name}={value!r}): give {what} (an int >= 1), or leave {name} out.")
    return value


def pipeline_options(values: Mapping[str, Any], call: str) -> dict[str, Any]:
    """``pp``, ``microbatches``, ``schedule`` and ``loss_fn`` of ``call()``: the stages, the
    micro-batches each batch is cut into (default: one per stage), the order they run in and
    the loss a schedule computes inside the call; refused with what they cannot be combined
    with."""
    pp = _count(call, "pp", values.get("pp"), "the number of stages each model is cut into")
    microbatches = _count(call, "microbatches", values.get("microbatches"),
                          "the number of micro-batches each batch is cut into")
    schedule, loss_fn = values.get("schedule"), values.get("loss_fn")
    if schedule is not None and schedule not in SCHEDULES:
        raise ConfigurationError(
            f"{call}(schedule={schedule!r}): give one of {', '.join(map(repr, SCHEDULES))}.")
    if loss_fn is not None and not callable(loss_fn):
        raise ConfigurationError(
            f"{call}(loss_fn={loss_fn!r}): give the loss as a function of (output, target), "
            "e.g. loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()).")
    if schedule == "1f1b" and loss_fn is None:
        raise ConfigurationError(
            f"{call}(schedule='1f1b') without loss_fn=: 1F1B starts each micro-batch's backward "
            "before the last forward, so the loss must be computed inside the call. Give "
            "loss_fn=f (f(output, target)) and call model(x, target=y), which returns the loss, "
            "or keep the default GPipe schedule and the plain loop.")
    if (pp or 1) == 1:
        given = [n for n, v in (("microbatches", microbatches), ("schedule", schedule),
                                ("loss_fn", loss_fn)) if v is not None]
        if given and "pp" not in values:
            raise ConfigurationError(
                f"{call}({given[0]}=...) without pp=: micro-batches, schedules and the loss "
                "handed to a schedule belong to a pipeline. Give pp=N (the stages), or use "
                "accumulate(k) to split the optimizer's step over k batches without a pipeline.")
        return {"pp": pp, "microbatches": None, "schedule": None, "loss_fn": None}
    if call == "sharded":
        raise ConfigurationError(
            f"sharded(pp={pp}): pipeline stages sharded by FSDP2 are not supported yet. Use "
            f"distributed(pp={pp}): each stage is replicated over the data-parallel ranks by "
            "DDP.")
    for other in ("tp", "sp", "cp"):
        if (values.get(other) or 1) > 1:
            raise ConfigurationError(
                f"{call}(pp={pp}, {other}={values[other]}): pipeline parallelism with "
                f"{'tensor' if other == 'tp' else 'sequence'} parallelism in one job is not "
                f"supported yet. Choose one of them.")
    return {"pp": pp, "microbatches": microbatches if microbatches is not None else pp,
            "schedule": schedule or "gpipe", "loss_fn": loss_fn}
