"""A model is sharded when the script first touches it, if that comes before its first forward.

Hand-written FSDP2 shards a model at ``fully_shard()``, right after building it, and every line
after that sees the sharded model: an optimizer over ``model.parameters()``, ``model.state_dict()``
(DTensors, with their ``device_mesh`` and ``placements``), ``load_state_dict``, DCP's
``get_model_state_dict``/``set_model_state_dict``. Under ``sharded()`` (and ``tp=``) a model is
sharded at its first forward, unless the script touches it before: then at that touch. A touch
is a call of ``parameters``, ``named_parameters``, ``buffers``, ``named_buffers``,
``state_dict``, ``load_state_dict`` or ``to_empty``, or a look-up of one of FSDP2's methods
(``unshard``, ``set_modules_to_forward_prefetch``...) that the model has not got yet
(:func:`fsdp_attribute`):

- made by the script itself or by DCP's state-dict functions; torch's own module code,
  accel_ctx and installed libraries (a ``from_pretrained`` building and loading a model) do not
  count, and the model is sharded at its first forward as before;
- on a model whose construction is over (no module's ``__init__`` is running: nanoGPT counts
  its parameters inside its ``__init__``);
- on any part of it: the outermost module it was built into (seen through torch's module
  registration hook while a scope is open) is the one sharded.

A model built on ``meta`` is sharded there on ``meta`` under ``sharded()``, as ``fully_shard``
would: its parameters are meta DTensors for the script to give values to (``to_empty()``
and ``reset_parameters()``, or a full state dict loaded with ``assign=True`` or through DCP),
and what is still on meta at its first forward is initialised then (``_engines.fsdp_meta``).
Under ``tp=`` or in one process a meta model is left to its first forward, as before.
"""

from __future__ import annotations

import os
import sysconfig
import threading
import types
import weakref

import torch
from torch import nn

from .._job.job import Job
from .._kernel import state as _state
from .._kernel.session import Session
from . import adopt as _adopt
from . import fsdp as _fsdp
from . import records as _records
from .choice import EngineChoice, Sharded

TOUCHES = ("parameters", "named_parameters", "buffers", "named_buffers", "state_dict",
           "load_state_dict", "to_empty")
"""The ``nn.Module`` methods that count as a touch (patched in ``_hooks.patches``)."""

_parents: dict[int, tuple[weakref.ref[nn.Module], weakref.ref[nn.Module]]] = {}
_busy = threading.local()
_DCP = os.sep + os.path.join("torch", "distributed", "checkpoint") + os.sep


def note_child(parent: nn.Module, name: str, child: nn.Module | None) -> None:
    """torch's global module registration hook: ``child`` now lives in ``parent``."""
    if child is None:
        return
    key = id(child)

    def gone(ref: weakref.ref[nn.Module]) -> None:
        entry = _parents.get(key)
        if entry is not None and entry[0] is ref:
            del _parents[key]

    _parents[key] = (weakref.ref(child, gone), weakref.ref(parent))


def _root_of(module: nn.Module) -> nn.Module:
    """The outermost module ``module`` lives in (as far as the registrations seen tell)."""
    for _ in range(256):
        entry = _parents.get(id(module))
        parent = entry[1]() if entry is not None and entry[0]() is module else None
        if parent is None or not any(c is module for c in parent._modules.values()):
            return module
        module = parent
    return module


def _installed_prefixes() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    places = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    places.add(os.path.dirname(torch.__file__))
    places.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # accel_ctx
    return tuple(os.path.join(os.path.realpath(p), "") for p in places)


_INSTALLED: tuple[str, ...] | None = None


def _by_the_script(caller: types.FrameType) -> bool:
    """The touch was made by the script's own code, or by DCP's state-dict functions."""
    global _INSTALLED
    filename = os.path.realpath(caller.f_code.co_filename)
    if _DCP in filename:
        return True
    if _INSTALLED is None:
        _INSTALLED = _installed_prefixes()
    return not filename.startswith(_INSTALLED)


def _under_construction(caller: types.FrameType) -> bool:
    """Some module's ``__init__`` is running: the model is not complete yet."""
    frame: types.FrameType | None = caller
    for _ in range(64):
        if frame is None:
            return False
        if frame.f_code.co_name == "__init__" and isinstance(frame.f_locals.get("self"),
                                                             nn.Module):
            return True
        frame = frame.f_back
    return False


def lay_out_at_touch(job: Job, engines: EngineChoice, module: nn.Module, session: Session,
                     caller: types.FrameType) -> None:
    """Shard (or split) the model ``module`` belongs to now, if this touch comes before its first
    forward; else nothing."""
    if _records.module_record(module) is not None or getattr(_busy, "on", False):
        return
    if not _by_the_script(caller) or _under_construction(caller):
        return
    root = _root_of(module)
    if (_records.module_record(root) is not None
            or isinstance(root, nn.parallel.DistributedDataParallel)
            or _adopt.managed_elsewhere(root)):  # the user's own engine (DataParallel too)
        return
    tensors = [*root.parameters(), *root.buffers()]
    if not tensors:
        return  # nothing to shard
    meta = any(t.is_meta for t in tensors)
    if meta and (job.world_size == 1 or not isinstance(engines, Sharded)):
        return  # nothing to shard here, or tp=: its first forward gives it values
    if job.world_size > 1 and _state.rank_only() is not None:
        return  # sharding is collective: the first forward on every rank does it
    _busy.on = True
    try:
        with _fsdp.sharding_as_built():
            engines.prepare(job, root, True, session)
    finally:
        _busy.on = False


_FSDP_NAMES: frozenset[str] | None = None


def fsdp_names() -> frozenset[str]:
    """The public methods of FSDP2's ``FSDPModule`` (``unshard``, ``reshard``...)."""
    global _FSDP_NAMES
    if _FSDP_NAMES is None:
        from torch.distributed.fsdp import FSDPModule

        _FSDP_NAMES = frozenset(n for n in vars(FSDPModule) if not n.startswith("_"))
    return _FSDP_NAMES


def fsdp_attribute(module: nn.Module, name: str, caller: types.FrameType) -> object:
    """``module.<name>`` found nothing and ``name`` is one of FSDP2's methods: a touch (the model
    is sharded now, as ``fully_shard`` would have done before), then the method; or, where the
    model is not sharded by this touch, an ``AttributeError`` saying why and what to do.

    Called by ``nn.Module.__getattr__``'s misses (``_engines.ddp_controls``) with the frame of the
    line that asked; a library's own probe (``hasattr(model, "unshard")``) shards nothing."""
    stack = _state.current()
    if stack is not None:
        for hook in stack.hooks.before_touch:
            hook(module, stack.session, caller)
    if hasattr(type(module), name):  # sharded now (its class is FSDP2's): the bound method
        return object.__getattribute__(module, name)
    raise AttributeError(_why_not_sharded(module, name, caller, stack))


def _why_not_sharded(module: nn.Module, name: str, caller: types.FrameType,
                     stack: _state.Stack | None) -> str:
    kind = type(module).__name__
    plain = f"'{kind}' object has no attribute '{name}'"
    if stack is None:
        return plain  # no scope of this thread: torch's own answer
    job = stack.job
    if job is None or not stack.hooks.before_touch:
        return (f"{plain}: {name}() is FSDP2's (FSDPModule), and no sharded() scope is open "
                "here to shard this model (under distributed() alone it trains with DDP, which "
                "has no such method). Build and train the model inside sharded() (with "
                "distributed(), sharded(): ...).")
    if not _by_the_script(caller):
        return plain
    if job.world_size == 1:
        return (f"{plain}: {name}() is FSDP2's (FSDPModule), and in one process sharded() "
                "shards nothing, so the model has none of FSDP2's methods. Call it only where "
                "the model is sharded: `if isinstance(model, FSDPModule): model."
                f"{name}(...)` (from torch.distributed.fsdp import FSDPModule).")
    if _state.rank_only() is not None:
        return (f"{plain} yet: {name}() is FSDP2's, and sharding the model here would be a "
                "collective in code only some ranks run (on_main_process & co.). Call it on "
                "every rank, or touch the model on every rank first (model.parameters()).")
    if _under_construction(caller):
        return (f"{plain} yet: {name}() is FSDP2's, and the model is still being built (a "
                "module's __init__ is running): sharded() shards it once built. Call it after "
                "the model's construction.")
    if _records.module_record(module) is not None:
        return (f"{plain}: {name}() is FSDP2's, and this {kind} is part of a sharded model "
                "but not sharded on its own (sharded() shards the blocks, then the model). Call "
                f"it on a block or on the model, or name {kind} in sharded(blocks=[{kind}]).")
    return (f"{plain}: {name}() is FSDP2's, and this {kind} is not sharded by sharded() (its "
            "model has nothing to shard, or another engine manages it).")
