"""Models built on ``meta`` under ``sharded()``: given memory and values, before or after sharding.

Two ways a meta model gets sharded:

- **At its first forward** (nothing touched it before): it is materialised module by module in
  module order, each module's ``reset_parameters()`` run on full tensors from rank 0's random
  stream (every rank draws the same numbers, so the shards form one model, and rank 0 draws what
  one process would), each block sharded as soon as it is complete (:func:`materialise`).
- **At a touch** (``model.parameters()``, ``state_dict()``, ``to_empty()``... before the first
  forward): sharded on ``meta`` as ``fully_shard`` would, so the script sees meta ``DTensor``s
  with their mesh and placements and gives them values itself, as FSDP2's scripts do
  (``model.to_empty(device=...)`` and ``reset_parameters()``, or a full state dict loaded with
  ``assign=True`` or DCP's ``set_model_state_dict``). The model is noted as waiting for values
  (:func:`note_waiting`); if any tensor is still on ``meta`` at its first forward (an optimizer was
  made, nothing else), :func:`give_values` initialises those as the first path would: full tensors
  from rank 0's stream, one module at a time, each then cut to this rank's shard.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from itertools import chain
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._job.job import Job
from .._kernel import state as _state
from .._kernel.session import Session
from ..errors import ConfigurationError
from . import adopt as _adopt

waiting_models: dict[int, weakref.ref[nn.Module]] = {}
"""Models sharded on meta at a touch, not yet called: id -> model (empty: nothing to check)."""
_state.reset_after_fork(waiting_models.clear)


def note_waiting(module: nn.Module) -> None:
    """``module`` was sharded on meta: its first forward checks that it has values."""
    key = id(module)

    def gone(ref: weakref.ref[nn.Module]) -> None:
        if waiting_models.get(key) is ref:
            del waiting_models[key]

    waiting_models[key] = weakref.ref(module, gone)


def waiting(module: nn.Module) -> bool:
    """Whether ``module`` was sharded on meta and has not been called since (cheap when none)."""
    ref = waiting_models.get(id(module))
    return ref is not None and ref() is module


def check_meta_init(module: nn.Module) -> None:
    """Every meta tensor must belong to a module that can initialise it: fail before sharding."""
    for name, sub in module.named_modules():
        direct = [k for k, v in chain(sub._parameters.items(), sub._buffers.items())
                  if v is not None and v.is_meta]
        if direct and not callable(getattr(sub, "reset_parameters", None)):
            where = f"{name}." if name else ""
            raise ConfigurationError(
                f"the model was built on the meta device, but {type(sub).__name__} "
                f"({where}{direct[0]}) has no reset_parameters() to give its tensors values "
                "after sharding. Give the module a reset_parameters() that initialises them, "
                "or build that part on a real device (torch.device('cpu')).")


def materialise(module: nn.Module, blocks: list[nn.Module], device: torch.device,
                shard_block: Callable[[nn.Module], None]) -> None:
    """Give every meta tensor storage on ``device`` and values from its module's
    ``reset_parameters()``, in module order; shard each block once it is complete."""
    block_of: dict[int, nn.Module] = {}
    left: dict[int, int] = {}
    for block in blocks:
        for sub in block.modules():
            block_of.setdefault(id(sub), block)
        left[id(block)] = sum(1 for _ in block.modules())
    made: dict[int, torch.Tensor] = {}  # tied tensors get one storage, as in the model
    for sub in module.modules():
        touched = False
        for store in _stores(sub):
            for key, value in list(store.items()):
                if value is None or not value.is_meta:
                    continue
                new = made.get(id(value))
                if new is None:
                    new = made[id(value)] = _empty_like(value, device)
                store[key] = new
                touched = True  # tied: reset again, as the module that owns it last would
        if touched:
            with torch.no_grad():
                sub.reset_parameters()  # type: ignore[operator]
        owner = block_of.get(id(sub))
        if owner is not None:
            left[id(owner)] -= 1
            if left[id(owner)] == 0:
                shard_block(owner)


def give_values(job: Job, module: nn.Module, session: Session) -> None:
    """``module`` was sharded on meta at a touch and is now called: initialise whatever is still
    on meta as :func:`materialise` would (the one-process values), keeping its shards."""
    waiting_models.pop(id(module), None)
    subs = [sub for sub in module.modules()
            if any(v is not None and v.is_meta for store in _stores(sub) for v in store.values())]
    if not subs:
        return  # the script gave it values (to_empty and reset_parameters, or a loaded state)
    check_meta_init(module)
    last_use: dict[int, int] = {}  # a tied tensor stays whole until its last module is reset
    for index, sub in enumerate(subs):
        for store in _stores(sub):
            for value in store.values():
                if value is not None and value.is_meta:
                    last_use[id(value)] = index
    before = dict(module.named_parameters())
    full: dict[int, torch.Tensor] = {}
    places: dict[int, list[tuple[dict[str, Any], str]]] = {}
    meta: dict[int, torch.Tensor] = {}
    with rank0_random_stream(job):
        for index, sub in enumerate(subs):
            for store in _stores(sub):
                for key, value in list(store.items()):
                    if value is None or not value.is_meta:
                        continue
                    if id(value) not in full:
                        full[id(value)] = _empty_like(value, job.device)
                        meta[id(value)] = value
                    places.setdefault(id(value), []).append((store, key))
                    store[key] = full[id(value)]
            with torch.no_grad():
                sub.reset_parameters()  # type: ignore[operator]
            for key_id in [k for k, last in last_use.items() if last == index]:
                sharded = _like_shard(meta.pop(key_id), full.pop(key_id))
                for store, key in places.pop(key_id):
                    store[key] = sharded
    _adopt.record_replaced(job, before, module)
    replaced = job.adoption.replaced
    for old_id, (old, new) in list(replaced.items()):
        later = replaced.get(id(new))
        if later is not None and later[0]() is new:  # built on meta -> sharded -> given values
            replaced[old_id] = (old, later[1])
    for optimizer in list(session.optimizers.keys()):
        _adopt.adopt_optimizer(job, optimizer)


def _stores(sub: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    return sub._parameters, sub._buffers


def _empty_like(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A full, plain tensor with ``value``'s global shape on ``device`` (a Parameter for one)."""
    if dist.is_available() and _is_dtensor(value):  # a shard's meta: the whole, contiguous
        empty = torch.empty(value.shape, dtype=value.dtype, device=device)
    else:  # its layout kept (channels_last weights stay so)
        empty = torch.empty_like(value, device=device)
    if isinstance(value, nn.Parameter):
        return nn.Parameter(empty, requires_grad=value.requires_grad)
    return empty


def _is_dtensor(value: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _like_shard(meta: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``full`` cut as the meta tensor it replaces is laid out (this rank's part of a DTensor,
    with no communication: every rank holds the same full values), or ``full`` itself."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(meta, DTensor):
        return full
    with torch.no_grad():
        local = distribute_tensor(full.detach(), meta.device_mesh, meta.placements,
                                  src_data_rank=None)
    if isinstance(meta, nn.Parameter):
        return nn.Parameter(local, requires_grad=meta.requires_grad)
    return local


@contextlib.contextmanager
def rank0_random_stream(job: Job) -> Iterator[None]:
    """Every rank draws rank 0's random numbers; rank 0 draws from its own stream, as one
    process would, and the other ranks' streams are left as they were."""
    cuda = job.device.type == "cuda"
    states: list[Any] = [torch.get_rng_state(),
                         torch.cuda.get_rng_state(job.device) if cuda else None]
    dist.broadcast_object_list(states, src=0)
    if job.rank == 0:
        yield
        return
    with torch.random.fork_rng(devices=[job.device] if cuda else []):
        torch.set_rng_state(states[0])
        if cuda:
            torch.cuda.set_rng_state(states[1], job.device)
        yield
