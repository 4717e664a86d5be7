"""``cp=N``: torch's ring attention (``context_parallel``'s CUDA kernels) on the slices ``sp``'s
split made.

Each rank holds a contiguous slice of every sequence (the split is ``sp=``'s: positions, labels
and loss weights alike). Around ``F.scaled_dot_product_attention`` the query, key and value
become DTensors sharded on the sequence over the sequence-parallel mesh, and torch's context
parallel dispatcher runs its ring attention on them (keys and values passed round the ring,
the partial results merged by their log-sum-exp); the output comes back as this rank's slice.
Contiguous slices mean torch's load balancing is off while the scope is open (its balancer
would reorder the sequence into head and tail chunks). torch has no CPU kernels for it: on CPU
``cp=`` is refused at the option, naming ``sp=``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._job.sequence import mask_refusal


@contextlib.contextmanager
def dispatching() -> Iterator[None]:
    """torch's context-parallel dispatcher on, load balancing off, for the scope."""
    from torch.distributed.tensor.experimental import _attention as cp

    balanced = cp._cp_options.enable_load_balance
    cp._cp_options.enable_load_balance = False  # the split's slices are contiguous
    cp._enable_context_parallel_dispatcher()
    try:
        yield
    finally:
        cp._disable_context_parallel_dispatcher()
        cp._cp_options.enable_load_balance = balanced


def attention(stock: Callable[..., torch.Tensor], mesh: Any, size: int, query: torch.Tensor,
              key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
              **more: Any) -> torch.Tensor:
    """``stock`` on DTensors sharded on the sequence (dimension 2): torch's ring attention."""
    from torch.distributed.tensor import DTensor, Shard

    if attn_mask is not None:
        raise mask_refusal(size, "cp")
    q, k, v = (DTensor.from_local(t.contiguous(), mesh, [Shard(2)], run_check=False)
               for t in (query, key, value))
    out = stock(q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **more)
    return out.to_local() if isinstance(out, DTensor) else out
