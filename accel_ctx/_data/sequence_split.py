"""Under ``sp=N``, each rank's slice of every sequence in the batches a loader yields.

Every rank of a sequence-parallel group receives the same batch (the data splits over the
groups); each keeps its slice of the sequence dimension. The rule for which tensors: the
batch's sequence length is dimension 1 of its ``input_ids`` (a mapping's key), else of its first
tensor with two or more dimensions; every tensor with two or more dimensions whose dimension 1
has that length is sliced there (input ids, labels, attention and position ids, embeddings),
anything else stays whole (per-sample labels, lengths). The labels counted for the loss's
weights are a mapping's ``labels``, else the last integer tensor sliced.

Examples:
    >>> import torch
    >>> from accel_ctx._job.sequence import SequenceShare
    >>> from accel_ctx._data.sequence_split import split_batch
    >>> share = SequenceShare(2, 1)
    >>> out = split_batch(share, {"input_ids": torch.arange(8).view(1, 8), "n": torch.ones(1)})
    >>> out["input_ids"].tolist(), out["n"].shape, share.length
    ([[4, 5, 6, 7]], torch.Size([1]), 8)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .._job.sequence import IGNORE_INDEX, SequenceShare
from .._kernel.tree import iter_tensors, map_tensors
from ..errors import ConfigurationError


def _length(batch: Any) -> int | None:
    if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor):
        ids = batch["input_ids"]
        return int(ids.shape[1]) if ids.dim() >= 2 else None
    return next((int(t.shape[1]) for t in iter_tensors(batch) if t.dim() >= 2), None)


def _labels(batch: Any, length: int) -> torch.Tensor | None:
    if isinstance(batch, Mapping):
        found = batch.get("labels")
        return found if isinstance(found, torch.Tensor) and found.dim() >= 2 else None
    if isinstance(batch, (list, tuple)):
        candidates = [t for t in batch if isinstance(t, torch.Tensor) and t.dim() >= 2
                      and t.shape[1] == length and not t.is_floating_point()]
        return candidates[-1] if len(candidates) > 1 else None  # inputs alone: no labels
    return None


def _per_rank(counted: torch.Tensor, size: int) -> list[int]:
    parts = counted.reshape(counted.shape[0], size, -1, *counted.shape[2:])
    return [int(n) for n in parts.transpose(0, 1).reshape(size, -1).sum(1).tolist()]


def _shifted(labels: torch.Tensor) -> torch.Tensor:
    """Labels shifted by one (position i counts token i+1), as HF's causal models shift them."""
    pad = torch.full_like(labels[:, :1], IGNORE_INDEX)
    return torch.cat([labels[:, 1:], pad], dim=1)


def split_batch(share: SequenceShare, batch: Any) -> Any:
    """``batch`` with this rank's slice of every sequence tensor; the share records them."""
    length = _length(batch)
    if length is None:
        return batch  # no sequences: every rank keeps the batch whole
    size = share.size
    if length % size:
        raise ConfigurationError(
            f"sp={size}: this batch's sequences are {length} tokens long, which does not split "
            f"into {size} equal slices. Pad each batch to a multiple of {size} (labels of the "
            f"padding -100; a tokenizer's pad_to_multiple_of={size}, or a collate_fn that pads).")
    start, stop = share.slice_of(length)
    labels = _labels(batch, length)
    share.made.clear()
    share.shifted.clear()
    share.length, share.uses_shifted, share.counts = length, False, None
    shifted = None
    if labels is not None:
        shifted = _shifted(labels)
        share.counts = (_per_rank(labels != IGNORE_INDEX, size),
                        _per_rank(shifted != IGNORE_INDEX, size))

    def cut(t: torch.Tensor) -> torch.Tensor:
        if t.dim() < 2 or t.shape[1] != length:
            return t
        part = t[:, start:stop].contiguous()  # contiguous: the loop's labels.view(-1) works
        share.made[id(part)] = part
        if t is labels and shifted is not None:
            share.shifted[id(part)] = shifted[:, start:stop].contiguous()
        return part

    return map_tensors(batch, cut)

