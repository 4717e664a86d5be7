"""Walking nested structures of tensors: tuples, lists, dicts, namedtuples, dataclasses.

Used for moving batches to the device, casting forward outputs and the collectives. Containers
are rebuilt with their own type; anything that is not a tensor or a known container is
returned as it is (or, for device moves, asked to ``.to(device)`` itself when it can).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar, cast, overload

import torch

_ATOMS = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device)


T = TypeVar("T")


@overload
def map_tensors(obj: T, fn: Callable[[torch.Tensor], torch.Tensor]) -> T: ...


@overload
def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any],
                other: Callable[[Any], Any] | None = None) -> Any: ...


def map_tensors(
    obj: Any,
    fn: Callable[[torch.Tensor], Any],
    other: Callable[[Any], Any] | None = None,
) -> Any:
    """Apply ``fn`` to every tensor in ``obj``; ``other`` (if given) to unknown leaves. Tensors
    mapped to tensors keep the structure's type (``map_tensors(batch, move) -> type(batch)``)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, _ATOMS):
        return obj
    cls = type(obj)
    if cls is tuple:
        return tuple(map_tensors(v, fn, other) for v in obj)
    if cls is list:
        return [map_tensors(v, fn, other) for v in obj]
    if cls is dict:
        return {k: map_tensors(v, fn, other) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return cls(*(map_tensors(v, fn, other) for v in obj))
    if isinstance(obj, Mapping):
        try:
            new = copy.copy(obj)
            for k, v in obj.items():
                new[k] = map_tensors(v, fn, other)  # type: ignore[index]
            return new
        except TypeError:  # read-only mapping: fall back to a plain dict
            return {k: map_tensors(v, fn, other) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = copy.copy(cast(Any, obj))
        for f in dataclasses.fields(obj):
            object.__setattr__(new, f.name, map_tensors(getattr(obj, f.name), fn, other))
        return new
    if isinstance(obj, (list, tuple)):
        items = [map_tensors(v, fn, other) for v in obj]
        try:
            return cls(items)
        except TypeError:
            return items
    if other is not None:
        return other(obj)
    return obj


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``obj``, in the order :func:`map_tensors` visits them."""
    found: list[torch.Tensor] = []

    def collect(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t

    map_tensors(obj, collect)
    return iter(found)


def to_device(obj: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor in ``obj`` to ``device``; objects with a ``.to`` method move themselves."""

    def move(t: torch.Tensor) -> torch.Tensor:
        return t if t.device == device else t.to(device, non_blocking=non_blocking)

    def move_other(o: Any) -> Any:
        to = getattr(o, "to", None)
        if callable(to) and not isinstance(o, torch.nn.Module):
            try:
                return to(device)
            except TypeError:
                return o
        return o

    return map_tensors(obj, move, move_other)


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """Cast floating-point tensors of lower precision than ``dtype`` to ``dtype``."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        if t.dtype in (torch.float16, torch.bfloat16) and t.dtype != dtype:
            return t.to(dtype)
        return t

    return map_tensors(obj, cast)
