"""``F.scaled_dot_product_attention`` while a sequence-parallel scope is open: Ulysses
(DeepSpeed-Ulysses). Each rank holds a slice of the sequence for every head; an all-to-all
turns that into the whole sequence for 1/N of the heads, torch's own SDPA runs on it, and an
all-to-all turns the result back (``cp=``: torch's ring attention, ``_engines.ring_attention``).

The all-to-alls are torch's differentiable ``all_to_all_single_autograd`` (its functional
collectives, as DTensor's redistribution uses them): the backward sends each gradient back the
same way, so a rank's parameters receive the gradient of every rank's loss through its slice.
The attention itself sees the whole sequence: ``is_causal`` and the softmax are exact.

Dynamo traces this module (it is not one of ``_hooks.tracing``'s modules run eagerly): the
scope's facts are read through :func:`sequence_size` and :func:`sequence_group`, which
``_hooks.tracing`` registers as constants at trace time, so a compiled model's attention and its
all-to-alls stay in one graph. A traced call is counted once, at trace time
(``SequenceShare.traced``); an eager one at every call (``attended``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed import _functional_collectives as _funcol

from .._engines import ring_attention as _ring
from .._job.sequence import SequenceShare, mask_refusal
from .._kernel import state as _state
from ..errors import ConfigurationError


def _not_installed(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("accel_ctx: the attention patch is not installed")


stock: Callable[..., torch.Tensor] = _not_installed
"""torch's own ``F.scaled_dot_product_attention``, set as the patch is installed."""


def _share() -> SequenceShare | None:
    stack = _state.current()
    job = stack.job if stack is not None else None
    share = job.sequence if job is not None else None
    return None if share is None or _state.rank_only() is not None else share


def _tracing() -> bool:
    """Whether Dynamo is tracing (it folds this module's reads then): torch 2.13's
    ``is_compiling()`` says so; torch 2.11's only its tracing context does (torch-private)."""
    if torch.compiler.is_compiling():
        return True
    guards = sys.modules.get("torch._guards")  # loaded with Dynamo: none, no tracing
    context = getattr(getattr(guards, "TracingContext", None), "try_get", None)
    return context is not None and context() is not None


def sequence_size() -> int:
    """The ranks that split each sequence in this thread's scope (0: none, or rank-only code);
    a constant while Dynamo traces. Counts the attention call it is asked for."""
    share = _share()
    if share is None:
        return 0
    if _tracing():
        share.traced = True  # asked at trace time: the compiled calls count nothing
    else:
        share.attended += 1
    return -share.size if share.ring else share.size


def sequence_group() -> str:
    """The name of this rank's sequence-parallel process group (a constant while tracing)."""
    share = _share()
    assert share is not None and share.group is not None
    return str(share.group.group_name)


def _check(size: int, query: torch.Tensor, key: torch.Tensor, attn_mask: Any) -> None:
    if attn_mask is not None:
        raise mask_refusal(size)
    if query.dim() != 4:
        raise ConfigurationError(
            f"sp={size}: scaled_dot_product_attention got a query of shape {tuple(query.shape)}; "
            "Ulysses needs (batch, heads, sequence, head_dim).")
    for name, t in (("query", query), ("key/value", key)):
        if t.shape[1] % size:
            raise ConfigurationError(
                f"sp={size}: attention has {t.shape[1]} {name} heads, which do not split over "
                f"{size} ranks (each rank attends over the whole sequence for 1/{size} of the "
                f"heads). Give sp a divisor of the number of heads ({t.shape[1]}), or a model "
                f"with a multiple of {size} heads.")


def _exchange(x: torch.Tensor, group: str) -> torch.Tensor:
    """All-to-all over dimension 0 (one block per rank), differentiable (torch's functional
    collective; ``torch.distributed.nn``'s is deprecated)."""
    exchanged = _funcol.all_to_all_single_autograd(x, None, None, group)  # type: ignore[arg-type]
    return _funcol.wait_tensor(exchanged)  # type: ignore[no-untyped-call,no-any-return]


def _to_heads(x: torch.Tensor, size: int, group: str) -> torch.Tensor:
    """(B, H, S/N, D), a slice of the sequence -> (B, H/N, S, D), the whole sequence."""
    b, h, s, d = x.shape
    blocks = x.reshape(b, size, h // size, s, d).permute(1, 0, 2, 3, 4).contiguous()
    got = _exchange(blocks, group)  # block j: rank j's slice of the sequence, for our heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * s, d)


def _to_sequence(x: torch.Tensor, size: int, group: str) -> torch.Tensor:
    """(B, H/N, S, D) -> (B, H, S/N, D): back to this rank's slice, for every head."""
    b, h, s, d = x.shape
    blocks = x.reshape(b, h, size, s // size, d).permute(2, 0, 1, 3, 4).contiguous()
    got = _exchange(blocks, group)  # block j: rank j's heads, for our slice
    return got.permute(1, 0, 2, 3, 4).reshape(b, h * size, s // size, d)


def scaled_dot_product_attention(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
        dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
        **more: Any) -> torch.Tensor:
    """Installed as ``F.scaled_dot_product_attention`` while an ``sp=``/``cp=`` scope is open:
    over the whole sequence of this thread's sequence-parallel ranks; else torch's own.

    Examples:
        >>> import torch
        >>> from accel_ctx._hooks.attention import _check
        >>> q = torch.zeros(1, 3, 4, 8)  # 3 heads cannot split over 2 ranks
        >>> try:
        ...     _check(2, q, q, None)
        ... except ValueError as exc:
        ...     print(str(exc)[:42])
        sp=2: attention has 3 query heads, which d
    """
    size = sequence_size()
    if size == 0:
        return stock(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                     is_causal=is_causal, scale=scale, **more)
    if size < 0:  # cp=: torch's ring attention, eagerly (a compiled model breaks here)
        share = _share()
        assert share is not None
        return _ring.attention(stock, share.mesh, -size, query, key, value, attn_mask,
                               dropout_p, is_causal, scale, **more)
    _check(size, query, key, attn_mask)
    group = sequence_group()
    q, k, v = (_to_heads(t, size, group) for t in (query, key, value))
    out = stock(q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **more)
    return _to_sequence(out, size, group)
