"""``sp=N``'s runtime: a model's call gets its slice's positions and labels, and the loss of
each rank weighs as its counted tokens do, so the averaged gradient is the whole sequence's.

Each rank's loss is the mean over the tokens of its slice (``n_r`` counted: labels that are not
-100). The whole sequence's mean loss is ``sum_r n_r * loss_r / sum_r n_r``; the gradients
average over every rank (DDP or FSDP2 over dp x sp), so each rank's backward runs on
``loss_r * n_r * N / sum_r n_r``. The counts come from the batch the loader split (every rank
holds it whole before slicing it): no collective. After the backward the user's ``loss`` holds
the whole sequence's loss (one all-reduce of a number), as one process would print it.

Positions: a model computes them from its input's length unless it is given them, and the
slice's length is not the sequence's. A forward that takes ``position_ids`` and was not given
them gets this rank's (``start .. stop`` of the whole sequence); one given the whole length's
gets its slice; a forward without ``position_ids`` that runs attention is refused, naming the
fix. HF's causal models shift their labels inside the slice (losing each slice's last target):
they get ``shift_labels``, the whole sequence's labels shifted, then sliced.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from typing_extensions import override

from .._job.job import Job
from .._job.sequence import SequenceShare
from .._kernel.concern import Concern, ForwardCall, Params
from .._kernel.order import ORDER
from .._kernel.session import Session
from .._kernel.tree import iter_tensors
from ..errors import ConfigurationError

_takes_positions: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()


def _accepts_positions(module: nn.Module) -> bool:
    module = getattr(module, "_orig_mod", module)  # torch.compile's wrapper: the model's forward
    cls = type(module)
    known = _takes_positions.get(cls)
    if known is None:
        try:
            parameters = inspect.signature(module.forward).parameters
        except (TypeError, ValueError):
            parameters = {}  # type: ignore[assignment]
        known = _takes_positions[cls] = "position_ids" in parameters
    return known


class SequenceParallelRuntime(Concern):
    """The sequence-parallel part of a ``distributed(sp=N)`` / ``sharded(sp=N)`` scope."""

    slot = "sequence"
    order = ORDER["sequence"]

    def __init__(self, job: Job, share: SequenceShare) -> None:
        self.job: Job = job
        self.share = share
        self._pending: tuple[torch.Tensor, float] | None = None
        self._call_attended = 0  # attention calls counted when this forward began
        self._sliced = False
        self._positions_missing = False

    # ---- a top-level call -----------------------------------------------------------------------
    @override
    def before_forward(self, call: ForwardCall, session: Session) -> None:
        share = self.share
        self._call_attended = share.attended
        self._sliced = any(share.is_slice(t) for t in iter_tensors((call.args, call.kwargs)))
        self._positions_missing = False
        if not self._sliced or share.length is None:
            return
        kwargs = call.kwargs
        positions = kwargs.get("position_ids")
        first = next(t for t in iter_tensors((call.args, call.kwargs)) if share.is_slice(t))
        if positions is None:
            if _accepts_positions(call.module):
                kwargs["position_ids"] = share.positions(first)
            else:
                self._positions_missing = True
        elif isinstance(positions, torch.Tensor) and not share.is_slice(positions):
            if positions.shape[-1] == share.length:  # the whole sequence's: its slice
                start, stop = share.slice_of(share.length)
                kwargs["position_ids"] = positions[..., start:stop]
            else:
                raise ConfigurationError(self._local_positions(call, positions))
        labels = kwargs.get("labels")
        if (labels is not None and "shift_labels" not in kwargs and share.is_slice(labels)
                and hasattr(call.module, "loss_function") and id(labels) in share.shifted):
            kwargs["shift_labels"] = share.shifted[id(labels)]  # HF: shifted across slices
            share.uses_shifted = True

    def _local_positions(self, call: ForwardCall, positions: torch.Tensor) -> str:
        share = self.share
        length = share.length or 0
        start, stop = share.slice_of(length)
        return (
            f"sp={share.size}: {type(call.module).__name__} got position_ids of length "
            f"{positions.shape[-1]}, a slice's length, made in the loop rather than by the split: "
            f"they cannot say which part of the {length}-token sequence a rank holds (sp rank "
            f"{share.rank} holds positions {start}..{stop - 1}). Pass the batch's own position_ids "
            "(a loader's batch key is sliced for you), positions of the whole length, or none.")

    @override
    def after_forward(self, call: ForwardCall, out: Any) -> Any:
        share = self.share
        name = type(getattr(call.module, "_orig_mod", call.module)).__name__
        # a compiled attention counts nothing when it runs: a call on slices is taken to attend
        attended = share.attended != self._call_attended or (share.traced and self._sliced)
        if not attended:
            if self._sliced:
                raise ConfigurationError(
                    f"sp={share.size}: {name} ran on slices of the sequences but called no "
                    "F.scaled_dot_product_attention, the attention that sp= runs over the whole "
                    "sequence: attention written by hand (HF's attn_implementation='eager') or "
                    "bound before the scope (from torch.nn.functional import ...) would attend "
                    "within each slice. Call torch.nn.functional.scaled_dot_product_attention "
                    "(HF: attn_implementation='sdpa'); a model without attention needs no sp=.")
            return out  # neither slices nor attention: a model on other data
        if not self._sliced:
            raise ConfigurationError(
                f"sp={share.size}: {name} ran attention on inputs that are no slices of a batch "
                "from a DataLoader in the scope (a batch made by hand, or a tensor computed from "
                "the batch, such as x[:, :-1]): each rank would attend over a sequence of its own. "
                "Iterate a DataLoader inside the scope and pass its tensors as they come (shift "
                "labels in the dataset or collate_fn).")
        if self._positions_missing:
            raise ConfigurationError(
                f"sp={share.size}: {name}.forward takes no position_ids, so it numbers the "
                f"positions of its slice from 0 (torch.arange(x.size(1))), not those of the whole "
                f"sequence. Give its forward a position_ids argument and use it for the positions "
                "(HF models take one), or drop sp=.")
        return out

    # ---- loss.backward() ------------------------------------------------------------------------
    @override
    def before_backward(self, loss: torch.Tensor, session: Session) -> torch.Tensor:
        if loss.numel() != 1:
            self._pending = None
            return loss
        weights = self.share.loss_weight()
        factor, share = weights if weights is not None else (1.0, 1.0 / self.share.size)
        self._pending = (loss, share)
        return loss if factor == 1.0 else loss * factor

    @override
    def after_backward(self, session: Session, params: Params) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        loss, share = pending
        with torch.no_grad():
            whole = loss.detach().to(torch.float64) * share
            dist.all_reduce(whole, group=self.share.group)
            loss.detach().copy_(whole)  # what one process would print for the step

    @override
    def splits_models(self) -> bool:
        return True  # each rank's gradient is its slice's part: local steps would drift
