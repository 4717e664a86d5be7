"""Collectives over nested structures of tensors: gather, reduce, broadcast, pad_across_processes.

Each reads the process group of the innermost ``distributed()`` scope when called. In a single
process (outside ``distributed()``, or a world of one) each returns its input itself, copying
nothing. Structures are tuples, lists, dicts, namedtuples and dataclasses (walked by ``_tree``),
rebuilt with their own types. Tensors travel where the backend takes them: CPU tensors through
gloo, CUDA tensors through NCCL; with an NCCL-only group, CPU tensors go through the runtime's
device and come back to the CPU. With several processes, gather and reduce return new tensors
without autograd history (broadcast too, except on ``src``, which gets its input back).

In debug mode (``distributed(debug=True)`` or ``ACCEL_CTX_DEBUG=1``) each collective first
checks, with the other ranks, that the calls fit together (see ``_debug``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch
import torch.distributed as dist

from . import _debug, _state
from ._blame import collective
from ._tree import iter_tensors, map_tensors
from .errors import ConfigurationError

if TYPE_CHECKING:
    from ._distributed import DistributedRuntime

T = TypeVar("T")
ReduceOp = Literal["sum", "mean", "max", "min"]
_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN}


def group_runtime() -> DistributedRuntime | None:
    """The innermost distributed() runtime when it has more than one process, else None."""
    stack = _state.current()
    runtime = stack.dist if stack is not None else None
    return runtime if runtime is not None and runtime.world_size > 1 else None


def comm_device(runtime: DistributedRuntime, device: torch.device) -> torch.device:
    """Where a tensor on ``device`` must be for the backend: NCCL alone cannot move CPU tensors."""
    if device.type == "cpu" and runtime.backend == "nccl":
        return runtime.device
    return device


def _meta_device(runtime: DistributedRuntime) -> torch.device:
    return comm_device(runtime, torch.device("cpu"))


def _leaves(obj: Any, call: str) -> list[torch.Tensor]:
    def refuse(other: Any) -> Any:
        raise ConfigurationError(
            f"{call} found a {type(other).__name__} in its input; it moves tensors (in tuples, "
            "lists, dicts, namedtuples, dataclasses). Use gather_object()/broadcast_object() for "
            "other objects, or convert them with torch.as_tensor() first."
        )

    map_tensors(obj, lambda t: t, refuse)
    leaves = list(iter_tensors(obj))
    if not leaves and obj is not None and not isinstance(obj, (tuple, list, dict)):
        refuse(obj)
    return leaves


def exchange_ints(runtime: DistributedRuntime, values: list[int]) -> list[list[int]]:
    """Every rank's ``values`` (same length on all ranks), in rank order: one small all_gather."""
    mine = torch.tensor(values, dtype=torch.int64, device=_meta_device(runtime))
    parts = [torch.empty_like(mine) for _ in range(runtime.world_size)]
    dist.all_gather(parts, mine)
    return [p.tolist() for p in parts]


def _pad_to(t: torch.Tensor, size: int, dim: int, value: Any, first: bool) -> torch.Tensor:
    missing = size - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    filler = torch.full(shape, value, dtype=t.dtype, device=t.device)
    return torch.cat((filler, t) if first else (t, filler), dim=dim)


def gather_tensor(
    runtime: DistributedRuntime, t: torch.Tensor, sizes: list[int], keep: list[bool] | None = None
) -> torch.Tensor:
    """Every rank's ``t`` concatenated along dim 0 (``sizes``: their dim 0; ``keep``: whose)."""
    scalar = t.dim() == 0
    x = t.detach().reshape(1) if scalar else t.detach()
    x = _pad_to(x.to(comm_device(runtime, t.device)), max(sizes), 0, 0, False).contiguous()
    parts = [torch.empty_like(x) for _ in range(runtime.world_size)]
    dist.all_gather(parts, x)
    kept = [p[:n] for r, (p, n) in enumerate(zip(parts, sizes, strict=True))
            if keep is None or keep[r]]
    return (torch.cat(kept) if kept else x[:0]).to(t.device)


@collective
def gather(tensors: T) -> T:
    """Concatenate every rank's tensors along dim 0, in rank order; the same result on all ranks.

    ``tensors`` is a tensor or a nested structure of them. First dimensions may differ between
    ranks (they are padded for the transfer and trimmed after); the other dimensions and the
    dtype must agree. A 0-dim tensor becomes one row per rank. Non-tensor leaves such as None are
    left as they are on this rank. In a single process the input itself is returned.

    Example:
        >>> import torch
        >>> from accel_ctx import gather
        >>> out = gather({"pred": torch.tensor([1, 2]), "loss": torch.tensor(0.5)})
        >>> out["pred"].tolist()  # one process: the input itself
        [1, 2]
    """
    runtime = group_runtime()
    if runtime is None:
        return tensors
    leaves = _leaves(tensors, "gather()")
    _debug.check(runtime, "gather()", leaves, free_dim=0)
    rows = exchange_ints(runtime, [t.shape[0] if t.dim() else 1 for t in leaves])
    done = iter([gather_tensor(runtime, t, [r[i] for r in rows]) for i, t in enumerate(leaves)])
    return map_tensors(tensors, lambda _: next(done))  # type: ignore[no-any-return]


@collective
def gather_object(obj: T) -> list[T]:
    """Every rank's ``obj`` (any picklable object), in rank order; ``[obj]`` in a single process.

    Objects are pickled; for tensors prefer :func:`gather`, which moves them without copying
    through Python.

    Example:
        >>> from accel_ctx import gather_object
        >>> gather_object({"rank": 0, "files": ["a.txt"]})
        [{'rank': 0, 'files': ['a.txt']}]
    """
    runtime = group_runtime()
    if runtime is None:
        return [obj]
    _debug.check(runtime, "gather_object()")
    parts: list[Any] = [None] * runtime.world_size
    dist.all_gather_object(parts, obj)
    return parts


@collective
def reduce(tensors: T, op: ReduceOp = "sum") -> T:
    """Combine every rank's tensors element-wise: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``.

    ``tensors`` is a tensor or a nested structure of them, of the same shapes and dtypes on
    every rank; every rank gets the result as new tensors (the inputs are left untouched). The
    mean of integer tensors is a floating-point tensor. In a single process the input itself is
    returned.

    Example:
        >>> import torch
        >>> from accel_ctx import reduce
        >>> reduce({"loss": torch.tensor(2.0)}, "mean")
        {'loss': tensor(2.)}
    """
    if op not in _OPS:
        raise ConfigurationError(f"reduce(op={op!r}): give one of 'sum', 'mean', 'max', 'min'.")
    runtime = group_runtime()
    if runtime is None:
        return tensors
    leaves = _leaves(tensors, f"reduce(op={op!r})")
    _debug.check(runtime, f"reduce(op={op!r})", leaves)
    results: dict[int, torch.Tensor] = {}
    # One all_reduce per dtype and device: many small metrics cost one round trip.
    for group in _groups(leaves, lambda t: (t.dtype, t.device)).values():
        device = comm_device(runtime, leaves[group[0]].device)
        flat = torch.cat([leaves[i].detach().reshape(-1).to(device) for i in group])
        dist.all_reduce(flat, _OPS[op])
        if op == "mean":
            flat = flat / runtime.world_size
        sizes = [leaves[i].numel() for i in group]
        for i, part in zip(group, torch.split(flat, sizes), strict=True):
            results[i] = part.view(leaves[i].shape).to(leaves[i].device)
    done = iter([results[i] for i in range(len(leaves))])
    return map_tensors(tensors, lambda _: next(done))  # type: ignore[no-any-return]


def _groups(items: list[Any], key: Callable[[Any], Any]) -> dict[Any, list[int]]:
    groups: dict[Any, list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault(key(item), []).append(i)
    return groups


class _Slot:
    """Stands for one tensor of the broadcast structure: its shape, dtype, and CPU or not."""

    __slots__ = ("accelerated", "dtype", "shape")

    def __init__(self, t: torch.Tensor) -> None:
        self.shape = tuple(t.shape)
        self.dtype = t.dtype
        self.accelerated = t.device.type != "cpu"


@collective
def broadcast(tensors: T, src: int = 0) -> T:
    """Every rank gets rank ``src``'s tensors (a tensor or a nested structure of them).

    Only ``src``'s input matters: shapes (first dimensions included), dtypes and the structure
    come from it, so the other ranks may pass anything, e.g. None. Tensors that ``src`` keeps on
    the CPU arrive on the CPU, the others on this rank's device. ``src`` gets its input back. In
    a single process the input itself is returned.

    Example:
        >>> import torch
        >>> from accel_ctx import broadcast
        >>> broadcast({"seed": torch.tensor(42)}, src=0)
        {'seed': tensor(42)}
    """
    runtime = group_runtime()
    if runtime is None:
        if src != 0:
            raise ConfigurationError(f"broadcast(src={src}): a single process has only rank 0.")
        return tensors
    _check_src(runtime, "broadcast", src)
    me = runtime.rank == src
    _debug.check(runtime, f"broadcast(src={src})")
    leaves = _leaves(tensors, "broadcast()") if me else []
    skeleton = [map_tensors(tensors, _Slot) if me else None]
    dist.broadcast_object_list(skeleton, src)
    slots: list[_Slot] = []
    map_tensors(skeleton[0], lambda t: t, lambda o: slots.append(o) if isinstance(o, _Slot) else o)
    received: dict[int, torch.Tensor] = {}
    for (dtype, accelerated), group in _groups(slots, lambda s: (s.dtype, s.accelerated)).items():
        home = runtime.device if accelerated else torch.device("cpu")
        device = comm_device(runtime, home)
        sizes = [_numel(slots[i].shape) for i in group]
        if me:
            flat = torch.cat([leaves[i].detach().reshape(-1).to(device) for i in group])
        else:
            flat = torch.empty(sum(sizes), dtype=dtype, device=device)
        dist.broadcast(flat, src)
        for i, part in zip(group, torch.split(flat, sizes), strict=True):
            received[i] = part.view(slots[i].shape).to(home)
    if me:
        return tensors
    done = iter([received[i] for i in range(len(slots))])
    return map_tensors(  # type: ignore[no-any-return]
        skeleton[0], lambda t: t, lambda o: next(done) if isinstance(o, _Slot) else o
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _check_src(runtime: DistributedRuntime, call: str, src: int) -> None:
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < runtime.world_size:
        raise ConfigurationError(
            f"{call}(src={src!r}): give a rank between 0 and {runtime.world_size - 1}."
        )


@collective
def broadcast_object(obj: T, src: int = 0) -> T:
    """Every rank gets rank ``src``'s ``obj`` (any picklable object); ``src`` gets its own back.

    Example:
        >>> from accel_ctx import broadcast_object
        >>> broadcast_object({"run_name": "baseline"})
        {'run_name': 'baseline'}
    """
    runtime = group_runtime()
    if runtime is None:
        if src != 0:
            raise ConfigurationError(
                f"broadcast_object(src={src}): a single process has only rank 0."
            )
        return obj
    _check_src(runtime, "broadcast_object", src)
    _debug.check(runtime, f"broadcast_object(src={src})")
    box: list[Any] = [obj if runtime.rank == src else None]
    dist.broadcast_object_list(box, src)
    return obj if runtime.rank == src else box[0]


@collective
def pad_across_processes(tensors: T, dim: int = 0, pad_index: Any = 0,
                         pad_first: bool = False) -> T:
    """Pad each tensor along ``dim`` to the largest size any rank has, so collectives fit.

    Fills with ``pad_index`` at the end (``pad_first=True``: at the start, e.g. left-padded
    token ids). Tensors already of the largest size, or without dimension ``dim``, are returned
    as they are. In a single process the input itself is returned.

    Example:
        >>> import torch
        >>> from accel_ctx import pad_across_processes
        >>> pad_across_processes(torch.tensor([[1, 2]]), dim=1).tolist()
        [[1, 2]]
    """
    runtime = group_runtime()
    if runtime is None:
        return tensors
    leaves = _leaves(tensors, "pad_across_processes()")
    _debug.check(runtime, f"pad_across_processes(dim={dim})", leaves, free_dim=dim)
    lengths = exchange_ints(
        runtime, [t.shape[dim] if -t.dim() <= dim < t.dim() else -1 for t in leaves]
    )
    padded = iter([
        t if lengths[runtime.rank][i] < 0
        else _pad_to(t, max(r[i] for r in lengths), dim, pad_index, pad_first)
        for i, t in enumerate(leaves)
    ])
    return map_tensors(tensors, lambda _: next(padded))  # type: ignore[no-any-return]
