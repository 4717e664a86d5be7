"""Checkpoints of a pipeline (``pp=N``): each stage saves and loads its part, whole-model names.

DCP writes every stage's tensors under the model's own names, so a pipeline's checkpoint is the
whole model's (it loads into one process as it is). What DCP does not know is the optimizer's
order of parameters, which the manifest records for the load's check: here the stages' lists
are joined in stage order (the model's own order: the first stage holds what comes first), and a
stage loading checks its part of them.

Examples:
    >>> from accel_ctx._checkpoint.stages import joined, part_of
    >>> saved = joined([{"opt": {"owners": ["m"], "params": [["a"]]}},
    ...                 {"opt": {"owners": ["m"], "params": [["b"]]}}], 2)
    >>> saved["opt"]["params"], part_of(saved["opt"]["params"], [["b"]])
    ([['a', 'b']], [['b']])
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch.distributed.checkpoint.state_dict import StateDictOptions

from .._kernel import state as _state


def stages() -> int:
    """The pipeline stages of the current job (1: no pipeline)."""
    return _state.coordinates().pp_size  # also under as_stock_torch(): the process's job


def joined(per_rank: list[dict[str, Any]], count: int) -> dict[str, Any]:
    """The optimizers' parameter names over the first pipeline's ``count`` stages (ranks
    ``0..count-1``), each param group's names in stage order (``count`` 1: rank 0's)."""
    if count == 1:
        return per_rank[0]
    out: dict[str, Any] = {}
    for name, record in per_rank[0].items():
        groups = [list(g) for g in record["params"]]
        for other in per_rank[1:count]:
            for mine, theirs in zip(groups, other.get(name, {}).get("params", []), strict=False):
                mine.extend(theirs)
        out[name] = {**record, "params": groups}
    return out


def part_of(saved: list[list[Any]], given: list[list[Any]]) -> list[list[Any]]:
    """The saved names a stage holding ``given`` loads (its part, in the saved order)."""
    held = {n for group in given for n in group}
    return [[n for n in group if n in held] for group in saved]


def optimizer_options(flat: bool) -> StateDictOptions | None:
    """How an optimizer's state is keyed: its param groups by parameter name (``flat``, as a
    pipeline saves them: each stage's groups hold other parameters, which index keys would mix
    up), else by index (DCP's default)."""
    return StateDictOptions(flatten_optimizer_state_dict=True) if flat else None


def saves_flat() -> bool:
    """Whether this job saves optimizers flat (a pipeline's stages do)."""
    return stages() > 1


def saved_flat(saved: Iterable[str], name: str) -> bool:
    """Whether a checkpoint whose keys are ``saved`` keeps optimizer ``name``'s groups by
    parameter name."""
    prefix = f"{name}.param_groups."
    for key in saved:
        if key.startswith(prefix):
            return not key[len(prefix):].split(".", 1)[0].isdigit()
    return False
