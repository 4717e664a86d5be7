"""Sequence parallelism's option (``sp=``) and the job's record of the current batch's split.

The loader's split (``_data.sequence_split``) writes the record; the sequence-parallel runtime
(``_engines.sequence_parallel``) reads it at the forward (which tensors are slices, the whole
length, the shifted labels an HF model takes) and at the backward (each rank's counted tokens).

Examples:
    >>> from accel_ctx._job.sequence import SequenceShare, parse_sp
    >>> parse_sp(2, None), SequenceShare(2, 1).slice_of(8)
    (2, (4, 8))
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import ConfigurationError

IGNORE_INDEX = -100  # what cross_entropy's ignore_index and HF's labels leave uncounted


def parse_sp(sp: object, tp: object, call: str = "distributed", name: str = "sp") -> int | None:
    """``sp`` (or ``cp``) checked: a positive int or None (1: none)."""
    if sp is None:
        return None
    if isinstance(sp, bool) or not isinstance(sp, int) or sp < 1:
        raise ConfigurationError(
            f"{call}({name}={sp!r}): give the number of ranks that split each sequence (an int "
            f">= 1), or leave {name} out.")
    if sp > 1 and isinstance(tp, int) and tp > 1:
        raise ConfigurationError(
            f"{call}({name}={sp}, tp={tp}): sequence and tensor parallelism in one job are not "
            f"supported yet. Choose one: {name}= splits each sequence (attention over the whole "
            "sequence), tp= splits each layer's weights.")
    return sp


def sequence_options(values: Mapping[str, Any], call: str) -> dict[str, int | None]:
    """The ``sp`` and ``cp`` options of ``call()``, checked: one of them, ``cp`` on CUDA only."""
    tp = values.get("tp")
    sp, cp = parse_sp(values.get("sp"), tp, call), parse_sp(values.get("cp"), tp, call, "cp")
    if (sp or 1) > 1 and (cp or 1) > 1:
        raise ConfigurationError(
            f"{call}(sp={sp}, cp={cp}): give one: sp= runs Ulysses attention (any device), cp= "
            "torch's ring attention (CUDA).")
    device = str(values.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
    if (cp or 1) > 1 and not device.startswith("cuda"):
        raise ConfigurationError(
            f"{call}(cp={cp}): ring attention (torch's context_parallel) has CUDA kernels only, "
            f"and this job runs on {device.split(':')[0]}. Use sp={cp}: the same split of every "
            "sequence, attention by Ulysses all-to-alls, on any device.")
    return {"sp": sp, "cp": cp}


def mask_refusal(size: int, name: str = "sp") -> ConfigurationError:
    """A mask holds one slice's rows only: refused, naming the fix."""
    return ConfigurationError(
        f"{name}={size}: scaled_dot_product_attention got an attn_mask, which holds this rank's "
        f"slice of the sequence only, not the whole sequence's attention. Under {name}= attention "
        "is causal or full without a mask: drop the attention mask (HF: pass no attention_mask, "
        "or one of all ones; pack sequences with position_ids instead of padding).")


class SequenceShare:
    """This rank's part of the current batch: which tensors the split made, the whole length,
    every rank's counted tokens (labels, and labels shifted by one as HF's causal models count)."""

    def __init__(self, size: int, rank: int, ring: bool = False) -> None:
        self.size, self.rank = size, rank
        self.ring = ring  # cp=: torch's ring attention on the mesh, not Ulysses on the group
        self.mesh: Any = None  # cp=: the 1-D mesh of the sequence-parallel ranks
        self.length: int | None = None  # the whole sequence of the current batch
        # tensors the split made (by id: a tensor's == is elementwise), and per local labels
        # tensor, its slice of the labels shifted by one (HF's shift_labels)
        self.made: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self.shifted: dict[int, torch.Tensor] = {}
        self.counts: tuple[list[int], list[int]] | None = None  # per rank: labels, shifted
        self.uses_shifted = False  # this batch's loss counts the shifted labels (an HF model)
        self.attended = 0  # attention calls that ran Ulysses (a forward that ran none is told)
        self.traced = False  # a compiled attention was traced (its calls count nothing)
        self.group: Any = None  # the sequence-parallel process group, made at the scope's entry

    def slice_of(self, length: int) -> tuple[int, int]:
        """This rank's ``[start, stop)`` of a sequence of ``length`` (a multiple of size)."""
        part = length // self.size
        return part * self.rank, part * (self.rank + 1)

    def is_slice(self, tensor: object) -> bool:
        """Whether the split made ``tensor`` (a slice of a batch's sequences)."""
        return isinstance(tensor, torch.Tensor) and self.made.get(id(tensor)) is tensor

    def loss_weight(self) -> tuple[float, float] | None:
        """This rank's loss factor ``n_r * size / sum(n)`` and its share ``n_r / sum(n)`` of
        the whole loss; None when no labels were counted (equal shares)."""
        if self.counts is None:
            return None
        counts = self.counts[1 if self.uses_shifted else 0]
        total = sum(counts)
        if total == 0:
            return None
        share = counts[self.rank] / total
        return share * self.size, share

    def positions(self, like: torch.Tensor) -> torch.Tensor:
        """This rank's positions in the whole sequence, shaped as ``like`` (batch, slice)."""
        start, stop = self.slice_of(self.length or like.shape[1] * self.size)
        return torch.arange(start, stop, device=like.device).unsqueeze(0).expand(like.shape[0], -1)
