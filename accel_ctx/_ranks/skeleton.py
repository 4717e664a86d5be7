"""Skeletons: a rank's input with each tensor replaced by a :class:`Slot`, and their merging.

A skeleton keeps the input's containers and its plain Python data; the tensors travel apart.
:func:`merge` combines every rank's skeleton with the gathered tensors, :func:`fill` puts one
rank's results back into its own skeleton.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any, cast

import torch
from typing_extensions import override


class Slot:
    """Stands for tensor number ``index`` of one rank's input (or for a Python number)."""

    __slots__ = ("index", "kind")

    def __init__(self, index: int, kind: str = "tensor") -> None:
        self.index = index
        self.kind = kind

    @override
    def __getstate__(self) -> tuple[int, str]:
        return self.index, self.kind

    def __setstate__(self, state: tuple[int, str]) -> None:
        self.index, self.kind = state


def rebuild_mapping(original: Mapping[Any, Any], values: dict[Any, Any]) -> Any:
    if type(original) is dict:
        return values
    try:
        new = copy.copy(original)
        new.update(values)  # type: ignore[attr-defined]
        return new
    except (TypeError, AttributeError):  # read-only mapping: a plain dict
        return values


def rebuild_sequence(original: Any, items: list[Any]) -> Any:
    try:
        return type(original)(items)
    except TypeError:
        return items


def merge(skeletons: list[Any], gathered: list[torch.Tensor]) -> Any:
    """Combine the ranks' skeletons (one structure, already checked to agree).

    Slots become the gathered tensors, batches of objects are concatenated in rank order, and
    a bare value becomes the list of every rank's value (as a 0-dim tensor becomes one row per
    rank).
    """
    first = skeletons[0]
    if isinstance(first, Slot):
        return gathered[first.index]
    if first is None:
        return None
    if isinstance(first, Mapping):
        return rebuild_mapping(first, {k: merge([s[k] for s in skeletons], gathered) for k in first})
    if isinstance(first, tuple) and hasattr(first, "_fields"):  # namedtuple
        return type(first)(*(merge(list(c), gathered) for c in zip(*skeletons, strict=True)))
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        new = copy.copy(cast(Any, first))
        for f in dataclasses.fields(first):
            object.__setattr__(new, f.name, merge([getattr(s, f.name) for s in skeletons],
                                                  gathered))
        return new
    if isinstance(first, (list, tuple)):
        if holds(first, Slot):  # a structure: position by position
            items = [merge(list(c), gathered) for c in zip(*skeletons, strict=True)]
            return items if type(first) is list else rebuild_sequence(first, items)
        return rebuild_sequence(first, [item for s in skeletons for item in s])  # a batch
    return list(skeletons)  # a bare value: one per rank


def holds(obj: Any, kind: type) -> bool:
    """Whether the nested structure ``obj`` holds an instance of ``kind`` anywhere."""
    if isinstance(obj, kind):
        return True
    if isinstance(obj, Mapping):
        return any(holds(v, kind) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(holds(v, kind) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return any(holds(getattr(obj, f.name), kind) for f in dataclasses.fields(obj))
    return False


def fill(skeleton: Any, values: list[Any]) -> Any:
    """The skeleton with each slot replaced by ``values[slot.index]`` (one rank's structure)."""
    if isinstance(skeleton, Slot):
        return values[skeleton.index]
    if skeleton is None or isinstance(skeleton, (str, bytes, int, float, complex)):
        return skeleton
    if isinstance(skeleton, Mapping):
        return rebuild_mapping(skeleton, {k: fill(v, values) for k, v in skeleton.items()})
    if isinstance(skeleton, tuple) and hasattr(skeleton, "_fields"):
        return type(skeleton)(*(fill(v, values) for v in skeleton))
    if dataclasses.is_dataclass(skeleton) and not isinstance(skeleton, type):
        new = copy.copy(cast(Any, skeleton))
        for f in dataclasses.fields(skeleton):
            object.__setattr__(new, f.name, fill(getattr(skeleton, f.name), values))
        return new
    if isinstance(skeleton, (list, tuple)):
        items = [fill(v, values) for v in skeleton]
        return items if type(skeleton) is list else rebuild_sequence(skeleton, items)
    return skeleton
