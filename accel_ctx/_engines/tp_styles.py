"""Tensor-parallel styles: what each named style of a plan becomes in torch, with sequence and
loss parallelism laid out as torchtitan lays them out (torch's ``loss_parallel()`` itself is
switched on in ``loss_parallel.py``, which loads no DTensor code until a scope asks for it).

Imported only when a tensor plan is resolved: it loads ``torch.distributed.tensor`` (about a
second), which a job without ``tp=`` never needs.

Alone, a named style is torch's ``ColwiseParallel`` / ``RowwiseParallel`` with the layouts its
name says (transformers' names included; an embedding split by rows takes whole token ids).

With a ``"sequence_parallel"`` entry (or torch's ``SequenceParallel``) on the norms, the
activations between the token embedding and the output layer are split along the sequence
(dim 1), torchtitan's layout: the embedding gives ``Shard(1)``; each ``"colwise"`` layer takes
the sequence-split output of a norm and gathers it; each ``"rowwise"`` layer gives ``Shard(1)``
back (a reduce-scatter instead of an all-reduce); the output layer gathers its input. Checked
where a wrong layout would be silent: the plan splits both ends, a colwise layer is fed by a
norm, the sequence divides by ``tp``.

With ``loss_parallel=True`` the output layer (the plan's ``"colwise_rep"`` /
``"colwise_gather_output"``) keeps its output split on the vocabulary, as a DTensor, and
torch's ``loss_parallel()`` is on while the scope is open, so the user's ``F.cross_entropy`` and
``loss.backward()`` compute on the shards (torch asks for both under it).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
)
from typing_extensions import override

from .._job.tp_plan import EXAMPLE, SPLITS
from ..errors import ConfigurationError

_GATHERED = ("colwise_rep", "colwise_gather_output", "embedding_colwise")
_SEQUENCE_EXAMPLE = ('tp_plan={"wte": "rowwise", "layers.*.ln_1": "sequence_parallel", ..., '
                     '"ln_f": "sequence_parallel", "lm_head": "colwise_rep"}')


def layout(module: nn.Module, chosen: dict[str, Any], tp: int,
           loss_parallel: bool) -> dict[str, Any]:
    """The plan ``chosen`` (module name -> style name or torch ParallelStyle) as torch styles."""
    sequence = any(_is_sequence(style) for style in chosen.values())
    subs = {name: module.get_submodule(name) for name in chosen}
    named = {name: style for name, style in chosen.items() if isinstance(style, str)}
    if sequence and any(not _is_sequence(style) for style in named.values()):
        embedding = any(isinstance(subs[name], nn.Embedding) for name in named)
        output = any(style in _GATHERED and isinstance(subs[name], nn.Linear)
                     for name, style in named.items())
        if not (embedding and output):
            missing = " and ".join(what for what, found in (
                ("the token embedding", embedding),
                ("the output layer ('colwise_rep')", output)) if not found)
            raise ConfigurationError(
                "tp_plan: 'sequence_parallel' splits the activations along the sequence from the "
                "token embedding to the output layer, so the plan must split both ends; it does "
                f"not split {missing} (a weight tied to another module stays whole, so a tied "
                f"embedding cannot: untie it, or leave out sequence_parallel). E.g. "
                f"{_SEQUENCE_EXAMPLE}.")
    if loss_parallel and not any(
            (style in _GATHERED and isinstance(subs[name], nn.Linear))
            or (not isinstance(style, str) and not _is_sequence(style))
            for name, style in chosen.items()):
        raise ConfigurationError(
            "loss_parallel=True keeps the output layer's logits split on the vocabulary, and "
            "the plan splits no output layer: name it with 'colwise_rep' (its output gathered "
            "without loss_parallel), e.g. tp_plan={..., \"lm_head\": \"colwise_rep\"}, or give "
            "torch's ColwiseParallel(use_local_output=False). An output layer tied to the "
            "embedding stays whole: untie it, or leave out loss_parallel.")
    return {name: _style(name, style, subs[name], tp, sequence, loss_parallel)
            for name, style in chosen.items()}


def _is_sequence(style: Any) -> bool:
    return style == "sequence_parallel" or isinstance(style, SequenceParallel)


def _style(name: str, style: Any, sub: nn.Module, tp: int, sequence: bool, loss: bool) -> Any:
    if not isinstance(style, str):
        return style
    if style == "sequence_parallel":
        return SequenceParallel()
    split = SPLITS.get(style)
    if split is None:
        raise ConfigurationError(
            f"tp_plan: the style {style!r} (declared by the model) is not one accel_ctx applies; "
            "give the plan yourself with 'colwise', 'rowwise' or torch ParallelStyles "
            f"(sharded(tp=..., {EXAMPLE})).")
    seq: Any = Shard(1)
    if isinstance(sub, nn.Embedding):  # token ids in, whole on every rank
        if split == "in" and sequence:
            return _IntoSequence(name, tp, input_layouts=Replicate(), output_layouts=seq)
        if split == "in":
            return RowwiseParallel(input_layouts=Replicate())
        if sequence:
            raise ConfigurationError(
                f"tp_plan: {name} is an embedding split '{style}' (by features), and "
                "sequence_parallel needs the token embedding split 'rowwise' (by vocabulary), "
                "so its output can be split along the sequence.")
        return ColwiseParallel(output_layouts=Replicate() if style in _GATHERED else Shard(-1))
    if split == "in":
        return RowwiseParallel(input_layouts=Replicate() if style != "rowwise" else Shard(-1),
                               output_layouts=seq if sequence else Replicate())
    gathered = style in _GATHERED
    out = Shard(-1) if not gathered or loss else Replicate()
    local = not (gathered and loss)  # loss_parallel: the logits stay a vocabulary-split DTensor
    if sequence:
        return _FromSequence(name, input_layouts=seq, output_layouts=out, use_local_output=local)
    return ColwiseParallel(output_layouts=out, use_local_output=local)


class _FromSequence(ColwiseParallel):
    """A colwise layer under sequence parallelism: gathers the sequence-split output of a
    'sequence_parallel' norm, and refuses a plain tensor, which it would take for this rank's
    part of the sequence (silently wrong when it holds all of it)."""

    def __init__(self, name: str, **layouts: Any) -> None:
        super().__init__(**layouts)
        self.name = name

    @override
    def _prepare_input_fn(  # type: ignore[override]  # torch's is static; this one knows the name
            self, input_layouts: Any, desired_input_layouts: Any, mod: nn.Module,
            inputs: Any, device_mesh: Any) -> Any:
        if not isinstance(inputs[0], DTensor):
            raise ConfigurationError(
                f"tp_plan: {self.name} is split 'colwise' under sequence_parallel, so its input "
                "must be the sequence-split output of a 'sequence_parallel' norm, and it got a "
                "plain tensor. Put 'sequence_parallel' on the norm that feeds it, or give "
                "this layer a torch ParallelStyle with the layouts it needs (e.g. "
                "ColwiseParallel() for an input that is whole on every rank).")
        return ColwiseParallel._prepare_input_fn(  # type: ignore[no-untyped-call]
            input_layouts, desired_input_layouts, mod, inputs, device_mesh)


class _IntoSequence(RowwiseParallel):
    """The token embedding under sequence parallelism: gives its output split along the
    sequence, which must divide by ``tp`` (uneven parts would be read back wrongly)."""

    def __init__(self, name: str, tp: int, **layouts: Any) -> None:
        super().__init__(**layouts)
        self.name, self.tp = name, tp

    @override
    def _prepare_input_fn(  # type: ignore[override]  # torch's is static; this one checks
            self, input_layouts: Any, desired_input_layouts: Any, mod: nn.Module,
            inputs: Any, device_mesh: Any) -> Any:
        length = inputs[0].shape[1] if inputs[0].dim() > 1 else 1
        if length % self.tp:
            raise ConfigurationError(
                f"tp_plan with sequence_parallel: {self.name} got sequences of {length} tokens, "
                f"which do not split over tp={self.tp} ranks. Make the sequence length a "
                f"multiple of {self.tp} (pad the batch), or leave out sequence_parallel.")
        return RowwiseParallel._prepare_input_fn(  # type: ignore[no-untyped-call]
            input_layouts, desired_input_layouts, mod, inputs, device_mesh)
