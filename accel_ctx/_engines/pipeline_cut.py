"""Cutting a model into pipeline stages, in place, keeping the whole model's names.

A model's repeated blocks (``sharded()`` finds them the same way: the children of a
``ModuleList``/``Sequential`` that are all of one class) are split into ``pp`` runs of
consecutive blocks, the first stage also keeping the parts registered before the blocks
(embeddings), the last the parts registered after them (norm, head), as torchtitan lays a
model out. Every part a stage does not run is replaced, where it sits, by a parameter-free
:class:`Stand-in <_StandIn>`, so the stage's ``state_dict()`` has the whole model's names for
what it holds, and nothing else. Parts without parameters (rotary embeddings, dropout) stay on
every stage.

The user's forward then runs unchanged on every stage, each microbatch once: before the stage's
blocks, the stand-ins hand on a placeholder (NaN, so that a value that leaks past the cut shows);
the stage's first block takes the activation the previous stage sent (``Mailbox.received``);
after its last block, the next block's stand-in sends the activation on and ends the forward
(:class:`StageDone`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from ..errors import ConfigurationError


class StageDone(Exception):  # a signal, not an error: the stage's part is done
    """Raised by the stand-in after a stage's last block: the rest of the forward is another
    stage's. Carries the activation to send on."""

    def __init__(self, activation: torch.Tensor) -> None:
        super().__init__("pipeline stage done")
        self.activation = activation


class StageProblem(Exception):  # turned into every stage's ConfigurationError
    """A shape of the model the stage cannot run, found in its forward: the runner hands its
    code on (every stage then refuses the step alike) and names ``where`` on this rank."""

    def __init__(self, code: int, where: str) -> None:
        super().__init__(where)
        self.code, self.where = code, where


SKIPPED, AFTER_CALLED_BEFORE, NO_TENSOR = 3, 4, 5


class Mailbox:
    """The current micro-batch's activation from the previous stage, and what this stage sends."""

    def __init__(self) -> None:
        self.received: torch.Tensor | None = None
        self.entered = False  # the stage's first block ran in this micro-batch's forward


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    hidden = kwargs.get("hidden_states")
    return hidden if isinstance(hidden, torch.Tensor) else None


class _StandIn(nn.Module):
    """Where a part of the model another stage runs sat: no parameters, no state."""

    def __init__(self, name: str, role: str, mailbox: Mailbox) -> None:
        super().__init__()
        self.part, self.role, self.mailbox = name, role, mailbox

    @override
    def extra_repr(self) -> str:
        return f"{self.part}: {self.role}"

    @override
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.role == "send":  # the first block after this stage's: the activation goes on
            activation = _first_tensor(args, kwargs)
            if activation is None:
                raise StageProblem(NO_TENSOR, f"block {self.part}")
            raise StageDone(activation)
        if self.role == "after":  # reached by skipping blocks, or called before them
            raise StageProblem(SKIPPED if self.mailbox.entered else AFTER_CALLED_BEFORE,
                               self.part)
        received = self.mailbox.received
        if received is None:
            raise ConfigurationError(
                f"pp=: {self.part} runs on another pipeline stage; call the whole model, not "
                "this part of it.")
        if self.role == "block":  # a block of an earlier stage: its input flows on untouched
            passed = _first_tensor(args, kwargs)
            return passed if passed is not None else received
        return torch.full_like(received, float("nan"))  # "before": a part of the first stage


class StageCut:
    """One rank's stage of a model: which blocks it runs, and the hook that feeds its first."""

    def __init__(self, stage: int, stages: int, blocks: list[str], first: int, stop: int,
                 removed: list[nn.Parameter]) -> None:
        self.stage, self.stages = stage, stages
        self.blocks, self.first, self.stop = blocks, first, stop
        self.removed = removed  # the parameters of the parts another stage runs
        self.handle: Any = None

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def describe(self) -> str:
        return (f"stage {self.stage} of {self.stages}: blocks {self.blocks[self.first]}.."
                f"{self.blocks[self.stop - 1]}")


def _blocks_of(model: nn.Module, stages: int) -> tuple[nn.Module, list[str]]:
    """The container of the model's repeated blocks and the blocks' names in the model."""
    names = {id(m): n for n, m in model.named_modules()}
    best: tuple[str, nn.Module, list[nn.Module]] | None = None  # the longest run of blocks
    for name, sub in model.named_modules():
        if isinstance(sub, (nn.ModuleList, nn.Sequential)):
            parts = list(sub.children())
            if parts and len({type(p) for p in parts}) == 1 and all(
                    any(True for _ in p.parameters()) for p in parts) and (
                    best is None or len(parts) > len(best[2])):
                best = name, sub, parts
    if best is not None and len(best[2]) >= stages:
        return best[1], [names[id(p)] for p in best[2]]
    if best is not None:
        name, _, parts = best
        raise ConfigurationError(
            f"pp={stages}: the model's blocks ({name}: {len(parts)} x "
            f"{type(parts[0]).__name__}) are fewer than the stages; give pp a number up to "
            f"{len(parts)}.")
    raise ConfigurationError(
        f"pp={stages}: this {type(model).__name__} has no repeated blocks to cut between (the "
        "children of a ModuleList or Sequential, all of one class, as transformer layers are). "
        "Hold the layers in an nn.ModuleList, or train without pp=.")


def _owner_and_name(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent_path, _, leaf = path.rpartition(".")
    return (model.get_submodule(parent_path) if parent_path else model), leaf


def cut(model: nn.Module, stage: int, stages: int, mailbox: Mailbox) -> StageCut:
    """Cut ``model`` in place down to ``stage``'s part; refused (before anything changes) where
    it cannot be cut: no blocks, parameters outside any part, a weight tied across stages."""
    container, blocks = _blocks_of(model, stages)
    count = len(blocks)
    first, stop = stage * count // stages, (stage + 1) * count // stages
    # the parts outside the blocks: the smallest modules off the path to the container
    parts: list[tuple[str, str]] = []  # (path, "before" | "after")
    side = "before"

    def visit(module: nn.Module, prefix: str) -> None:
        nonlocal side
        own = [n for n, p in module.named_parameters(recurse=False)]
        if own:
            raise ConfigurationError(
                f"pp={stages}: {prefix or type(model).__name__} holds parameters itself "
                f"({', '.join(own)}), beside the blocks it contains, so no stage can own them. "
                "Move them into a submodule (an nn.Module of their own) registered before or "
                "after the blocks.")
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if child is container:
                side = "after"
            elif any(c is container for c in child.modules()):
                visit(child, path)
            elif any(True for _ in child.parameters()):
                parts.append((path, side))

    visit(model, "")
    owner_stage: dict[int, tuple[int, str]] = {}

    def stage_of(path: str, where: str) -> int:
        if where == "block":
            return blocks.index(path) * stages // count
        return 0 if where == "before" else stages - 1

    for path, where in [*((b, "block") for b in blocks), *parts]:
        at = stage_of(path, where)
        for p in model.get_submodule(path).parameters():
            seen = owner_stage.setdefault(id(p), (at, path))
            if seen[0] != at:
                raise ConfigurationError(
                    f"pp={stages}: {seen[1]} and {path} share a parameter (tied weights), and "
                    f"they run on stages {seen[0]} and {at}. Untie them (give each its own "
                    "weight), or use fewer stages so that both fall on one.")
    removed: list[nn.Parameter] = []

    def stand_in(path: str, role: str) -> None:
        owner, leaf = _owner_and_name(model, path)
        removed.extend(owner.get_submodule(leaf).parameters())
        setattr(owner, leaf, _StandIn(path, role, mailbox))

    for index, path in enumerate(blocks):
        if index < first:
            stand_in(path, "block")
        elif index >= stop:
            stand_in(path, "send" if index == stop else "block")
    for path, where in parts:
        if stage_of(path, where) != stage:
            stand_in(path, where)
    result = StageCut(stage, stages, blocks, first, stop, removed)
    entry = model.get_submodule(blocks[first])
    result.handle = entry.register_forward_pre_hook(_feeder(mailbox), with_kwargs=True)
    return result


def _feeder(mailbox: Mailbox) -> Callable[..., Any]:
    """The stage's first block takes the previous stage's activation in place of its input."""

    def feed(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        mailbox.entered = True
        received = mailbox.received
        if received is None:  # the first stage: its own input
            return None
        if args and isinstance(args[0], torch.Tensor):
            return (received, *args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            return args, {**kwargs, "hidden_states": received}
        raise StageProblem(NO_TENSOR, type(module).__name__)

    return feed
