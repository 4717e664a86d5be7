"""Pipeline parallelism's options (``pp=``, ``microbatches=``), checked where they are given.

Examples:
    >>> from accel_ctx._job.stages import pipeline_options
    >>> pipeline_options({"pp": 2}, "distributed")
    {'pp': 2, 'microbatches': 2}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ConfigurationError


def _count(call: str, name: str, value: object, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(
            f"{call}({name}={value!r}): give {what} (an int >= 1), or leave {name} out.")
    return value


def pipeline_options(values: Mapping[str, Any], call: str) -> dict[str, int | None]:
    """``pp`` and ``microbatches`` of ``call()``: the stages, and the micro-batches each batch
    is cut into (default: one per stage); refused with what they cannot be combined with."""
    pp = _count(call, "pp", values.get("pp"), "the number of stages each model is cut into")
    microbatches = _count(call, "microbatches", values.get("microbatches"),
                          "the number of micro-batches each batch is cut into")
    if (pp or 1) == 1:
        if microbatches is not None and "pp" not in values:
            raise ConfigurationError(
                f"{call}(microbatches={microbatches}) without pp=: micro-batches are how a "
                "pipeline keeps its stages busy. Give pp=N (the stages), or use accumulate(k) "
                "to split the optimizer's step over k batches without a pipeline.")
        return {"pp": pp, "microbatches": None}
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
    return {"pp": pp, "microbatches": microbatches if microbatches is not None else pp}
