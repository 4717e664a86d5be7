"""Ulysses attention (DeepSpeed-Ulysses): each rank holds a slice of the sequence for every head;
an all-to-all turns that into the whole sequence for 1/N of the heads, torch's own
``scaled_dot_product_attention`` runs on it, and an all-to-all turns the result back.

The all-to-alls are torch's differentiable ``all_to_all_single_autograd`` (its functional
collectives, as DTensor's redistribution uses them): the backward sends each gradient back the same way, so a
rank's parameters receive the gradient of every rank's loss through its slice. The attention
itself sees the whole sequence: ``is_causal`` and the softmax are exact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed import _functional_collectives as _funcol

from ..errors import ConfigurationError


def refuse_mask(size: int, attn_mask: Any, name: str = "sp") -> None:
    """A mask holds one slice's rows only: refused, naming the fix."""
    if attn_mask is not None:
        raise ConfigurationError(
            f"{name}={size}: scaled_dot_product_attention got an attn_mask, which holds this "
            "rank's slice of the sequence only, not the whole sequence's attention. Under "
            f"{name}= attention is causal or full without a mask: drop the attention mask (HF: "
            "pass no attention_mask, or one of all ones; pack sequences with position_ids "
            "instead of padding).")


def _check(size: int, query: torch.Tensor, key: torch.Tensor, attn_mask: Any) -> None:
    refuse_mask(size, attn_mask)
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


def _exchange(x: torch.Tensor, group: Any) -> torch.Tensor:
    """All-to-all over dimension 0 (one block per rank), differentiable (torch's functional
    collective; ``torch.distributed.nn``'s is deprecated)."""
    exchanged = _funcol.all_to_all_single_autograd(x, None, None, group)
    return _funcol.wait_tensor(exchanged)  # type: ignore[no-untyped-call,no-any-return]


def _to_heads(x: torch.Tensor, size: int, group: Any) -> torch.Tensor:
    """(B, H, S/N, D), a slice of the sequence -> (B, H/N, S, D), the whole sequence."""
    b, h, s, d = x.shape
    blocks = x.reshape(b, size, h // size, s, d).permute(1, 0, 2, 3, 4).contiguous()
    got = _exchange(blocks, group)  # block j: rank j's slice of the sequence, for our heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * s, d)


def _to_sequence(x: torch.Tensor, size: int, group: Any) -> torch.Tensor:
    """(B, H/N, S, D) -> (B, H, S/N, D): back to this rank's slice, for every head."""
    b, h, s, d = x.shape
    blocks = x.reshape(b, h, size, s // size, d).permute(2, 0, 1, 3, 4).contiguous()
    got = _exchange(blocks, group)  # block j: rank j's heads, for our slice
    return got.permute(1, 0, 2, 3, 4).reshape(b, h * size, s // size, d)


def attention(stock: Callable[..., torch.Tensor], group: Any, size: int, query: torch.Tensor,
              key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
              **more: Any) -> torch.Tensor:
    """``stock`` (torch's SDPA) over the whole sequence of ``group``'s slices, per head share.

    Examples:
        >>> import torch
        >>> from accel_ctx._engines.ulysses import _check
        >>> q = torch.zeros(1, 3, 4, 8)  # 3 heads cannot split over 2 ranks
        >>> try:
        ...     _check(2, q, q, None)
        ... except ValueError as exc:
        ...     print(str(exc)[:42])
        sp=2: attention has 3 query heads, which d
    """
    _check(size, query, key, attn_mask)
    q, k, v = (_to_heads(t, size, group) for t in (query, key, value))
    out = stock(q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **more)
    return _to_sequence(out, size, group)
