"""Tensor-parallel plans: which module paths split their weights how (``tp=``, ``tp_plan=`` of
``sharded()`` and ``distributed()``), checked where they are given.

A plan maps module path patterns to styles. ``*`` matches one path segment
(``layers.*.attn.q_proj``, as torchtitan's and transformers' plans write them). A style is
``"colwise"`` (split the output features), ``"rowwise"`` (split the input features, sum the
outputs), the spellings transformers' plans use (``"colwise_rep"`` / ``"colwise_gather_output"``,
``"rowwise_rep"`` / ``"rowwise_split_input"``, ``"embedding_rowwise"`` / ``"embedding_colwise"``,
``"replicate"``), ``"sequence_parallel"``, or any torch ``ParallelStyle``.

Examples:
    >>> from accel_ctx._job.tp_plan import parse_tp, matches
    >>> plan = parse_tp(2, {"layers.*.attn.q_proj": "colwise"}, "sharded")
    >>> plan.size, plan.styles
    (2, (('layers.*.attn.q_proj', 'colwise'),))
    >>> matches("layers.*.attn.q_proj", "layers.3.attn.q_proj"), matches("layers.*", "layers.3.attn")
    (True, False)
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigurationError

SPLITS = {"colwise": "out", "colwise_rep": "out", "colwise_gather_output": "out",
          "embedding_colwise": "out", "rowwise": "in", "rowwise_rep": "in",
          "rowwise_split_input": "in", "embedding_rowwise": "in"}
"""The named styles that split a weight: "out" its output features (a Linear's rows, an
Embedding's columns), "in" its input features (a Linear's columns, an Embedding's rows)."""

STYLE_NAMES = (*SPLITS, "sequence_parallel", "replicate")
"""The styles a plan may name by string (torch's ``ParallelStyle`` objects are taken as well):
transformers' names for the same splits included, so its models' plans apply as they are."""

EXAMPLE = ('tp_plan={"layers.*.attn.q_proj": "colwise", "layers.*.attn.k_proj": "colwise", '
           '"layers.*.attn.v_proj": "colwise", "layers.*.attn.out_proj": "rowwise", '
           '"layers.*.mlp.up": "colwise", "layers.*.mlp.down": "rowwise"}')
"""How a plan is written (quoted in the errors that ask for one)."""


@dataclass(frozen=True)
class TensorPlan:
    """Tensor parallelism asked of a scope: the group size and the plan (None: the model's own)."""

    size: int
    styles: tuple[tuple[str, Any], ...] | None = None
    """(pattern, style) pairs in the order given; None reads the plan the model declares."""
    loss_parallel: bool = False
    """The output layer's logits stay split on the vocabulary, and torch's ``loss_parallel()``
    is on in the scope (the user's cross-entropy and backward compute on the shards)."""


def matches(pattern: str, path: str) -> bool:
    """``path`` (a module name) fits ``pattern``, where ``*`` stands for one path segment."""
    parts, names = pattern.split("."), path.split(".")
    return len(parts) == len(names) and all(
        fnmatch.fnmatchcase(name, part) for part, name in zip(parts, names, strict=True))


def _is_style(value: object) -> bool:
    from torch.distributed.tensor.parallel import ParallelStyle

    return isinstance(value, ParallelStyle)


def parse_tp(tp: object, tp_plan: object, call: str = "distributed",
             loss_parallel: object = False) -> TensorPlan | None:
    """``tp``, ``tp_plan`` and ``loss_parallel`` as given to ``call()``, checked; None without
    tensor parallelism."""
    if not isinstance(loss_parallel, bool):
        raise ConfigurationError(
            f"{call}(loss_parallel={loss_parallel!r}): give True (the loss computed on the "
            "vocabulary-split logits of the output layer) or False.")
    if tp is None:
        for name, value in (("tp_plan", tp_plan is not None), ("loss_parallel", loss_parallel)):
            if value:
                raise ConfigurationError(
                    f"{call}({name}=...) without tp=: say over how many ranks each layer is "
                    f"split, e.g. {call}(tp=2, {name}=...).")
        return None
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigurationError(
            f"{call}(tp={tp!r}): give the number of ranks that split each layer (an int >= 1 "
            "that divides the number of processes, usually the GPUs of one machine), or None.")
    if tp_plan is None:
        return TensorPlan(tp, None, loss_parallel) if tp > 1 else None
    if not isinstance(tp_plan, Mapping) or not tp_plan:
        raise ConfigurationError(
            f"{call}(tp_plan={tp_plan!r}): give a dict of module path patterns to styles, "
            f"e.g. {EXAMPLE}; or leave it None for a model that declares its own plan "
            "(transformers' models do).")
    styles: list[tuple[str, Any]] = []
    for key, style in tp_plan.items():
        if not isinstance(key, str) or not key or any(not part for part in key.split(".")):
            raise ConfigurationError(
                f"{call}(tp_plan=...): the key {key!r} is not a module path; write paths as "
                "model.named_modules() names them, '*' for one segment (\"layers.*.mlp.up\").")
        if isinstance(style, str) and style.lower() in STYLE_NAMES:
            style = style.lower()
        elif not _is_style(style):
            raise ConfigurationError(
                f"{call}(tp_plan=...): {key!r} has the style {style!r}; give one of "
                f"{', '.join(repr(n) for n in STYLE_NAMES)} or a torch ParallelStyle "
                "(torch.distributed.tensor.parallel.ColwiseParallel(...)).")
        styles.append((key, style))
    return TensorPlan(tp, tuple(styles), loss_parallel) if tp > 1 else None


def tp_options(values: Mapping[str, Any], call: str) -> dict[str, Any]:
    """The ``tp``, ``tp_plan`` and ``loss_parallel`` options of ``call()``, checked and settled
    (``tp_plan`` as (pattern, style) pairs; ``tp=1`` is none)."""
    tensor = parse_tp(values.get("tp"), values.get("tp_plan"), call,
                      values.get("loss_parallel", False))
    if tensor is None:
        return {"tp": values.get("tp"), "tp_plan": None, "loss_parallel": False}
    return {"tp": tensor.size, "tp_plan": tensor.styles, "loss_parallel": tensor.loss_parallel}
