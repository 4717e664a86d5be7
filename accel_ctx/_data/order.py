"""Every rank draws the same order of batches each epoch, or the job stops saying why.

Before an epoch draws its order, every random number generator that can decide it is given
rank 0's state: torch's global generator, the loader's ``generator`` and every
``torch.Generator`` found on the sampler, the batch sampler (and the samplers they hold) or,
for an iterable dataset, the dataset. Rank 0 then builds its iterator first and sends, in
the same broadcast as the states, a fingerprint of the first batch it drew; every other rank
draws from the states it received and compares. A sampler that draws from something else
(Python's ``random``, NumPy, a generator it creates inside ``__iter__``) would give the ranks
overlapping shares: the mismatching rank raises a :class:`DistributedError` naming the sampler
and the fix. One broadcast per epoch, as before; nothing per step.

A rank's own random stream stays its own (:mod:`.own_stream`).
"""

from __future__ import annotations

import numbers
import struct
import types
import zlib
from collections.abc import Callable, Mapping
from itertools import islice
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from .._group.blame import refuse_rank_only
from ..errors import DistributedError
from .own_stream import is_datapipe, own_global_stream
from .shard import EMPTY

T = TypeVar("T")
_WALK_BUDGET = 2000  # objects looked at when searching a sampler for its generators
_SKIP = (str, bytes, numbers.Number, torch.Tensor, type, types.ModuleType, types.FunctionType,
         types.MethodType, types.BuiltinFunctionType, nn.Module, DataLoader)


def order_generators(loader: DataLoader[Any]) -> list[torch.Generator]:
    """The generators besides torch's global one that may decide ``loader``'s order."""
    found: list[torch.Generator] = []
    seen: set[int] = {id(torch.default_generator)}
    budget = [_WALK_BUDGET]

    def walk(obj: Any, depth: int) -> None:
        if id(obj) in seen or budget[0] <= 0 or depth > 4 or obj is None:
            return
        seen.add(id(obj))
        budget[0] -= 1
        if isinstance(obj, torch.Generator):
            found.append(obj)
        elif isinstance(obj, _SKIP):
            return
        elif isinstance(obj, (list, tuple)):  # not sets: their order differs between ranks
            for item in islice(obj, 64):
                walk(item, depth + 1)
        elif isinstance(obj, Mapping):
            for item in islice(obj.values(), 64):
                walk(item, depth + 1)
        elif isinstance(obj, Dataset) and not (depth == 0 and isinstance(obj, IterableDataset)):
            return  # a map-style dataset does not decide the order (its augmentations stay)
        else:
            attributes = getattr(obj, "__dict__", None)
            if isinstance(attributes, dict):
                for item in islice(attributes.values(), 64):
                    walk(item, depth + 1)

    walk(loader.generator, 0)
    walk(loader.sampler, 0)
    walk(loader.batch_sampler, 0)
    if isinstance(loader.dataset, IterableDataset):
        walk(loader.dataset, 0)
    return found


def _states(generators: list[torch.Generator]) -> list[torch.Tensor]:
    return [torch.get_rng_state(), *(g.get_state() for g in generators)]


def _set_states(generators: list[torch.Generator], states: list[torch.Tensor]) -> None:
    """The loader's own generators (not the global one) take rank 0's states."""
    for generator, state in zip(generators, states, strict=True):
        generator.set_state(state)


def shared_start(
    loader: DataLoader[Any],
    job: Any,
    build: Callable[[], T],
    first: Callable[[T], Any],
) -> tuple[T, list[torch.Tensor], list[torch.Generator]]:
    """Build the epoch's iterator from rank 0's RNG states; check the order agrees.

    Returns the iterator, the states it started from and the generators they belong to (the
    global one first, then :func:`order_generators`).
    """
    refuse_rank_only("iter() of a shuffled DataLoader (an evaluation on one rank: shuffle=False)",
                     "the broadcast that makes the ranks agree on its order")
    generators = order_generators(loader)
    states = _states(generators)
    sizes = [s.numel() for s in states]
    device = job.comm_device(torch.device("cpu"))
    if is_datapipe(loader.dataset):  # it broadcasts while being built
        buffer = torch.cat([torch.zeros(16, dtype=torch.uint8), *states]).to(device)
        dist.broadcast(buffer, src=0)
        states = [s.clone() for s in torch.split(buffer.cpu()[16:], sizes)]
        _set_states(generators, states[1:])
        with own_global_stream(states[0]):
            return build(), states, generators
    if job.rank == 0:
        it = build()
        header = torch.tensor([1, fingerprint(first(it))], dtype=torch.int64).view(torch.uint8)
        dist.broadcast(torch.cat([header, *states]).to(device), src=0)
        return it, states, generators
    buffer = torch.empty(16 + sum(sizes), dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=0)
    received = buffer.cpu()
    states = [s.clone() for s in torch.split(received[16:], sizes)]
    _set_states(generators, states[1:])
    with own_global_stream(states[0], loader):
        it = build()
        mine = fingerprint(first(it))
    expected = int(received[8:16].view(torch.int64).item())
    if mine != expected:
        raise DistributedError(_mismatch(loader, job.rank, generators))
    return it, states, generators


def fingerprint(obj: Any) -> int:
    """A 32-bit digest of a batch (or a batch of indices), equal on equal content.

    Objects without a stable representation count by their type only: a fingerprint may miss
    a difference, never invent one.
    """
    return _feed(obj, 0, 0)


def _feed(obj: Any, crc: int, depth: int) -> int:
    if obj is EMPTY:
        return crc
    if isinstance(obj, torch.Tensor):
        return zlib.crc32(_tensor_digest(obj), crc)
    if obj is None or isinstance(obj, (str, bytes, bool, numbers.Number)):
        return zlib.crc32(repr(obj).encode(), crc)
    if depth < 6 and isinstance(obj, (list, tuple)):
        if all(isinstance(x, int) for x in obj):  # the common case: a batch of indices
            return zlib.crc32(repr(list(obj)).encode(), crc)
        crc = zlib.crc32(b"[", crc)
        for item in obj:
            crc = _feed(item, crc, depth + 1)
        return zlib.crc32(b"]", crc)
    if depth < 6 and isinstance(obj, Mapping):
        for key, value in obj.items():
            crc = _feed(value, _feed(key, crc, depth + 1), depth + 1)
        return crc
    if type(obj).__module__ == "numpy" and hasattr(obj, "dtype"):
        try:
            return zlib.crc32(_tensor_digest(torch.as_tensor(obj)), crc)
        except (TypeError, RuntimeError, ValueError):
            pass
    return zlib.crc32(type(obj).__qualname__.encode(), crc)


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _tensor_digest(t: torch.Tensor) -> bytes:
    """Shape, dtype and a position-weighted integer sum of (a strided sample of) the bits."""
    head = f"{t.dtype}{tuple(t.shape)}".encode()
    try:
        flat = t.detach().reshape(-1)
        if flat.is_complex():
            flat = torch.view_as_real(flat).reshape(-1)
        step = max(1, flat.numel() // 65536)
        flat = flat[::step].cpu().contiguous()
        if flat.dtype == torch.bool:
            flat = flat.to(torch.uint8)
        bits = flat.view(_INT_VIEW[flat.element_size()]).to(torch.int64)
        weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64) * 2654435761
        return head + struct.pack("<q", int((bits * weights).sum().item()))
    except (KeyError, RuntimeError, TypeError):  # an exotic dtype: shape and dtype only
        return head


def _describe(loader: DataLoader[Any]) -> str:
    if isinstance(loader.dataset, IterableDataset):
        return f"the IterableDataset {type(loader.dataset).__qualname__}"
    batch_sampler = loader.batch_sampler
    inner = getattr(batch_sampler, "sampler", None)
    if batch_sampler is not None and type(batch_sampler).__name__ != "BatchSampler":
        return f"the batch sampler {type(batch_sampler).__qualname__}"
    return f"the sampler {type(inner if inner is not None else loader.sampler).__qualname__}"


def _mismatch(loader: DataLoader[Any], rank: int, generators: list[torch.Generator]) -> str:
    what = _describe(loader)
    reached = "torch's global generator"
    if generators:
        reached += f" and the {len(generators)} torch.Generator(s) found on the loader"
    if isinstance(loader.dataset, IterableDataset):
        return (
            f"rank {rank}: {what} began its epoch with a different batch on this rank than on "
            f"rank 0 (or with none), although every rank started from rank 0's random states "
            f"({reached}). accel_ctx gives each rank every world_size-th batch of one stream, "
            "so the stream must be the same on every rank. Either it splits itself between the "
            "ranks (it reads the rank, e.g. datasets' split_dataset_by_node): let it yield the "
            "whole stream on every rank and accel_ctx takes this rank's share; or it shuffles "
            "with a random number generator accel_ctx cannot reach (Python's random module, "
            "NumPy): keep a torch.Generator on the dataset (self.generator = torch.Generator(), "
            "then torch.randperm(n, generator=self.generator)), or seed its generator "
            "identically on every rank at each epoch (e.g. random.Random(seed + epoch))."
        )
    return (
        f"rank {rank}: {what} drew a different order of batches on this rank than on rank 0, "
        f"although every rank started the epoch from rank 0's random states ({reached}). It "
        "draws from a random number generator accel_ctx cannot reach (Python's random module, "
        "NumPy, or a generator it creates or hides), so the ranks would train on overlapping "
        "samples and skip others. Fix: keep a torch.Generator on the sampler (e.g. "
        "self.generator = torch.Generator(), then torch.randperm(n, generator=self.generator)) "
        "or pass DataLoader(generator=...); or seed the generator it uses identically on every "
        "rank at each epoch (e.g. random.Random(seed + epoch)). If it splits the data between "
        "ranks itself, use torch's DistributedSampler instead: accel_ctx then leaves that "
        "loader's sharding to it."
    )
