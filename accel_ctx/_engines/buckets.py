"""Reduce many tensors in place with one collective per bucket (device and dtype).

Local SGD's parameter average and the replica groups' gradient average both flatten their
tensors into one buffer per bucket, reduce it with one call, and copy the values back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


@torch.no_grad()
def reduce_in_buckets(
    tensors: Iterable[torch.Tensor],
    reduce: Callable[[torch.Tensor], None],
    as_dtype: torch.dtype | None = None,
    on: Callable[[torch.device], torch.device] | None = None,
) -> None:
    """Change ``tensors`` in place by ``reduce``, called once per bucket on a flat buffer.

    A bucket is the tensors of one device and dtype (``as_dtype``: one buffer of that dtype per
    device, e.g. float32 for an exact average); ``on`` moves a bucket's buffer to the device its
    collective runs on. ``reduce`` changes the buffer in place.

    Examples:
        >>> t = [torch.ones(2), torch.full((3,), 2.0)]
        >>> reduce_in_buckets(t, lambda flat: flat.mul_(10))
        >>> [x.tolist() for x in t]
        [[10.0, 10.0], [20.0, 20.0, 20.0]]
    """
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        buckets.setdefault((t.device, as_dtype or t.dtype), []).append(t)
    for (device, dtype), group in buckets.items():
        flat = torch.cat([t.detach().reshape(-1).to(dtype) for t in group])
        if on is not None:
            flat = flat.to(on(device))
        reduce(flat)
        offset = 0
        for t in group:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor itself under no_grad), else the tensor.

    >>> local_shard(torch.ones(2)).tolist()
    [1.0, 1.0]
    """
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor
