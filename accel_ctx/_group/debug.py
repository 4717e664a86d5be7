"""Debug mode: before each collective the ranks compare what they are about to send.

With ``distributed(debug=True)`` or ``ACCEL_CTX_DEBUG=1`` each collective (and each
``wait_for_everyone()``) first meets the other ranks at a sync point of ``_group.barrier``, where every
rank leaves a description of its call: which collective, from which line, with tensors of which
shapes and dtypes. Mismatches become one error, raised on every rank, that lists every rank's
call, instead of a hang or a crash deep inside the backend. Without debug mode this costs nothing.

Mismatched *inputs* to one collective are caught without debug mode too, inside the message
each call sends anyway (``_ranks.exchange``, ``_ranks.reduce``, ``_ranks.broadcast``); debug mode adds what only a
separate meeting can catch: ranks in different calls, and the user's line in each.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import wrapt

from ..errors import DistributedError
from . import barrier as _barrier

if TYPE_CHECKING:
    from .._job.job import Job

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # accel_ctx/
_SKIPPED = (_PACKAGE_DIR, os.path.abspath(contextlib.__file__),
            os.path.dirname(os.path.abspath(wrapt.__file__)))
BARRIER = "barrier"


def _caller() -> str:
    """The first frame outside accel_ctx, wrapt and contextlib: the user's line."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if not filename.startswith(_SKIPPED):
            return f"{os.path.basename(filename)}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "?"


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def check(
    job: Job,
    call: str,
    tensors: Sequence[torch.Tensor] | None = None,
    free_dim: int | None = None,
    compare_shapes: bool = True,
) -> None:
    """In debug mode, meet the other ranks and raise if their calls do not fit together.

    ``call`` names the collective with the arguments that must agree ("reduce(op='sum')");
    ``free_dim`` is the dimension allowed to differ (gather's dim 0); ``compare_shapes=False``
    compares dtypes and counts only (broadcast receivers' inputs are ignored: not even those).
    """
    if not job.debug:
        return
    mine: dict[str, Any] = {"call": call, "where": _caller()}
    if tensors is not None:
        mine["tensors"] = [[_shape(t), str(t.dtype).removeprefix("torch.")] for t in tensors]
    signatures = _barrier.sync_point(job, call, json.dumps(mine), read=True)
    ranks = [json.loads(s) for s in signatures]
    problem = _compare(ranks, free_dim, compare_shapes)
    if problem is not None:
        listing = "\n".join(f"  rank {r}: {_describe(s)}" for r, s in enumerate(ranks))
        raise DistributedError(
            f"rank {job.rank}: {call} stopped by debug mode before it could hang or fail "
            f"inside torch: {problem}.\n{listing}\n{_advice(problem)}"
        )


def barrier(job: Job, call: str) -> None:
    """A failure-aware barrier; in debug mode it also checks every rank is in a barrier."""
    if not job.debug:
        _barrier.sync_point(job, call)
        return
    signatures = _barrier.sync_point(
        job, call, json.dumps({"call": call, "where": _caller(), "kind": BARRIER}), read=True
    )
    ranks = [json.loads(s) for s in signatures]
    if any(s.get("kind") != BARRIER for s in ranks):
        listing = "\n".join(f"  rank {r}: {_describe(s)}" for r, s in enumerate(ranks))
        raise DistributedError(
            f"rank {job.rank}: {call} stopped by debug mode: the ranks are in different "
            f"calls.\n{listing}\n{_advice('different calls')}"
        )


def _compare(ranks: list[dict[str, Any]], free_dim: int | None, compare_shapes: bool) -> str | None:
    if len({s["call"] for s in ranks}) > 1:
        return "the ranks are in different calls"
    if any(s.get("tensors") is None for s in ranks):
        return None
    listed: list[list[Any]] = [s["tensors"] for s in ranks]
    if len({len(t) for t in listed}) > 1:
        return "the ranks pass different numbers of tensors"
    for leaves in zip(*listed, strict=True):
        if len({dtype for _, dtype in leaves}) > 1:
            return "the ranks pass tensors of different dtypes"
        if not compare_shapes:
            continue
        if len({len(shape) for shape, _ in leaves}) > 1:
            return "the ranks pass tensors with different numbers of dimensions"
        fixed = {
            tuple(d for i, d in enumerate(shape) if i != _normalise(free_dim, len(shape)))
            for shape, _ in leaves
        }
        if len(fixed) > 1:
            return "the ranks pass tensors of different shapes" + (
                f" (only dim {free_dim} may differ)" if free_dim is not None else ""
            )
    return None


def _normalise(dim: int | None, ndim: int) -> int | None:
    if dim is None:
        return None
    return dim + ndim if dim < 0 else dim


def _describe(signature: dict[str, Any]) -> str:
    text = f"{signature['call']} at {signature['where']}"
    tensors = signature.get("tensors")
    if tensors is not None:
        shapes = ", ".join(f"#{i} {tuple(s)} {dtype}" for i, (s, dtype) in enumerate(tensors))
        text += f" with tensors [{shapes}]"
    return text


def _advice(problem: str) -> str:
    if "different calls" in problem:
        return (
            "Every rank must make the same sequence of collective and wait_for_everyone() calls; "
            "look for a call under a rank test (`if state().is_main_process:`) or a loop that "
            "runs a different number of times on some ranks."
        )
    return (
        "Make the ranks pass the same nested structure with tensors of one dtype and matching "
        "shapes (gather: all dimensions but dim 0; reduce: all), e.g. with "
        "pad_across_processes() or a cast before the call."
    )
