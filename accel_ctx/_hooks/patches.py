"""Scoped patches: installed with the first scope, gated per call, undone with the last.

Every patched entry point first reads the ContextVar; with no scope of this thread and process
it is the stock function. Otherwise the call site runs the hooks of the open concerns
(``_kernel.concern.Concern``) in their order; what each concern does lives in its own module.

Intercepted: ``nn.Module.__call__`` (top-level calls only), ``nn.Module.__getattr__`` (its misses
only: DDP's names on an adopted model, ``_engines.ddp_controls``), ``Tensor.backward``,
``DataLoader.__iter__``/``__len__`` (and the index sampler its iterator reads),
``Optimizer.step`` (through torch's global step hooks, so every call path is seen; the
``chain`` of ``torch.optim.optimizer``'s hook loops, so a held-back step runs no hook),
``Optimizer.zero_grad``, ``Module.zero_grad``, ``Module.parameters``/``named_parameters``/
``buffers``/``named_buffers``/``state_dict``/``load_state_dict`` (a touch before a sharded
model's first forward shards it: ``_engines.touch``; torch's module registration hook says
which model a part lives in), ``LRScheduler.step`` and subclasses defining
their own, ``torch.nn.utils.clip_grad_norm_``/``clip_grad_value_``, and ``GradScaler``'s
``scale``/``unscale_``/``step``/``update``/``get_scale`` (a user's own defers to an fp16
scope's), ``set_epoch`` of every Sampler and Dataset class defining it (a call the loop makes
itself marks the object as driven by the loop) and, once the user's code has imported Dynamo,
``OptimizedModule.__call__`` (a compiled model that DDP's engine calls inside the user's own call
of it does not set torch's flag again).
Not intercepted: ``torch.autograd.backward``/``autograd.grad``, DataLoader subclasses that
override ``__iter__``, classes defined after the first scope opened, and names bound with
``from torch.nn.utils import clip_grad_norm_`` before it opened (use ``accel_ctx``'s own).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import wrapt
from torch import nn
from torch.optim import lr_scheduler
from torch.optim import optimizer as _optim_module
from torch.utils.data import DataLoader, Dataset, Sampler

from .._data import epochs as _epochs
from .._data import iterate as _data
from .._data.torch_private import INDEX_SAMPLER, index_sampler_property
from .._engines import touch as _touch
from .._kernel import state as _state
from .._steps import clip as _clip
from ..errors import PatchConflictError
from . import attention as _sdpa
from . import gates as _gates
from . import replacements as _replacements
from . import step_gates as _step_gates
from . import tracing as _tracing
from . import user_scaler as _user_scaler

_MISSING: Any = object()

_lock = threading.RLock()
_users = 0
_undo: list[Callable[[], None]] = []


class _AttributePatch:
    """One attribute of one class or module, replaced and later put back exactly."""

    def __init__(self, owner: Any, name: str, replacement: Any) -> None:
        self.owner, self.name, self.replacement = owner, name, replacement
        self.original = owner.__dict__.get(name, _MISSING)

    def install(self) -> None:
        setattr(self.owner, self.name, self.replacement)

    def uninstall(self) -> None:
        now = self.owner.__dict__.get(self.name, _MISSING)
        where = f"{getattr(self.owner, '__qualname__', self.owner.__name__)}.{self.name}"
        if now is not self.replacement:
            raise PatchConflictError(
                f"{where} was replaced by other code while an accel_ctx scope was open; "
                "accel_ctx left it as it is now. Apply the other library's patch outside the "
                "scope (before entering or after leaving it)."
            )
        if self.original is _MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.original)


def _wrap(owner: Any, name: str, gate: Callable[..., Any]) -> _AttributePatch:
    return _AttributePatch(owner, name, wrapt.FunctionWrapper(getattr(owner, name), gate))


def _classes_defining(base: type, name: str) -> Iterator[type]:
    seen: set[type] = set()
    todo = [base]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        if name in cls.__dict__:
            yield cls
        todo.extend(cls.__subclasses__())


# ------------------------------------------------------------------------------------------------
# install / uninstall
# ------------------------------------------------------------------------------------------------
def acquire() -> None:
    """Install every patch if this is the first open scope of the process."""
    global _users
    with _lock:
        if _users == 0:
            _install()
        _users += 1


def _forget_in_forked_child() -> None:
    """A forked child (DataLoader worker, launch()) has none of its parent's scopes open."""
    global _users, _lock, _attention_users
    _lock = threading.RLock()  # the parent's may have been held by a thread that is gone
    if _attention_users:
        _attention_users = 0
        with contextlib.suppress(PatchConflictError):
            _attention.uninstall()
    if _users:
        _users = 0
        with contextlib.suppress(PatchConflictError):
            _uninstall()


# F.scaled_dot_product_attention: only while a sequence-parallel scope is open (a compiled
# model in any other scope traces torch's own function)
_attention_users = 0
_attention = _AttributePatch(torch.nn.functional, "scaled_dot_product_attention",
                             _sdpa.scaled_dot_product_attention)


def acquire_attention() -> None:
    """Route ``F.scaled_dot_product_attention`` through Ulysses (``_hooks.attention``)."""
    global _attention_users
    with _lock:
        if _attention_users == 0:
            _attention.original = torch.nn.functional.__dict__["scaled_dot_product_attention"]
            _sdpa.stock = _attention.original
            _attention.install()
        _attention_users += 1


def release_attention() -> None:
    """Put torch's own attention back when the last sequence-parallel scope closes."""
    global _attention_users
    with _lock:
        _attention_users -= 1
        if _attention_users == 0:
            _attention.uninstall()


_state.reset_after_fork(_forget_in_forked_child)


def release() -> None:
    """Undo every patch when the last open scope of the process closes."""
    global _users
    with _lock:
        _users -= 1
        if _users == 0:
            _uninstall()


def installed() -> bool:
    with _lock:
        return _users > 0


_SCALER_GATES = {
    "scale": _user_scaler.scale,
    "unscale_": _user_scaler.unscale,
    "step": _user_scaler.step,
    "update": _user_scaler.update,
    "get_scale": _user_scaler.get_scale,
}


def _install() -> None:
    _gates.stock.backward = torch.Tensor.__dict__["backward"]
    _gates.stock.module_call = nn.Module.__dict__["__call__"]
    module_call = _replacements.module_call_for(_gates.stock.module_call)
    _tracing.installing(module_call)
    patches = [
        _AttributePatch(nn.Module, "__call__", module_call),
        _AttributePatch(nn.Module, "__getattr__", _replacements.module_getattr_for(nn.Module.__dict__["__getattr__"])),
        _AttributePatch(_optim_module, "chain", _step_gates.HookChain),
        _AttributePatch(torch.Tensor, "backward", _replacements.tensor_backward_for(_gates.stock.backward)),
        _wrap(DataLoader, "__iter__", _gates.loader_iter),
        _wrap(DataLoader, "__len__", _gates.loader_len),
        _AttributePatch(DataLoader, INDEX_SAMPLER, index_sampler_property(_data.building_view)),
        _wrap(nn.Module, "zero_grad", _step_gates.zero_grad),
    ]
    patches += [_wrap(nn.Module, name, _gates.module_touch) for name in _touch.TOUCHES]
    patches += [_wrap(c, "zero_grad", _step_gates.zero_grad) for c in _classes_defining(torch.optim.Optimizer, "zero_grad")]
    patches += [_wrap(c, "step", _step_gates.scheduler_step) for c in _classes_defining(lr_scheduler.LRScheduler, "step")]
    for name, gate in _SCALER_GATES.items():  # a user's GradScaler defers to an fp16 scope's
        patches += [_wrap(c, name, gate) for c in _classes_defining(torch.amp.GradScaler, name)]
    # set_epoch calls the loop makes itself (a DistributedSampler it drives): see _epochs
    epoch_owners = {c for base in (Sampler, Dataset) for c in _classes_defining(base, "set_epoch")}
    patches += [_wrap(c, "set_epoch", _epochs.note_call)
                for c in sorted(epoch_owners, key=lambda c: c.__qualname__)]
    for module in (torch.nn.utils, torch.nn.utils.clip_grad):
        patches.append(_AttributePatch(module, "clip_grad_norm_", _routed(module.clip_grad_norm_, _clip.clip_grad_norm_)))
        patches.append(_AttributePatch(module, "clip_grad_value_", _routed(module.clip_grad_value_, _clip.clip_grad_value_)))
    patches += _dynamo_patches()
    try:
        for patch in patches:
            patch.install()
            _undo.append(patch.uninstall)
        pre = _optim_module.register_optimizer_step_pre_hook(_step_gates.before_step)
        _undo.append(pre.remove)
        _run_first(_optim_module._global_optimizer_pre_hooks, pre.id)
        post = _optim_module.register_optimizer_step_post_hook(_step_gates.after_step)
        _undo.append(post.remove)
        # which module a part lives in, for a touch of the part (_engines.touch)
        children = nn.modules.module.register_module_module_registration_hook(_touch.note_child)
        _undo.append(children.remove)
    except BaseException:
        _uninstall()
        raise


def _install_dynamo_patches() -> None:
    """Dynamo was imported after the first scope opened (``_hooks.tracing`` calls this then)."""
    with _lock:
        if _users == 0:
            return
        for patch in _dynamo_patches():
            patch.install()
            _undo.append(patch.uninstall)


_tracing.on_dynamo_loaded = _install_dynamo_patches


def _run_first(hooks: dict[int, Any], key: int) -> None:
    """Make the hook under ``key`` the first of ``hooks``: a held-back step() then runs no
    other hook (``_hooks.step_gates.HookChain``)."""
    others = [(k, hooks.pop(k)) for k in list(hooks) if k != key]
    hooks.update(others)


def _uninstall() -> None:
    conflicts: list[PatchConflictError] = []
    while _undo:
        undo = _undo.pop()
        try:
            undo()
        except PatchConflictError as exc:
            conflicts.append(exc)
    if conflicts:
        raise conflicts[0]


# ------------------------------------------------------------------------------------------------
# torch.compile(model).__call__, once the user's code has imported Dynamo
# ------------------------------------------------------------------------------------------------
def _dynamo_patches() -> list[_AttributePatch]:
    """The patches of Dynamo's classes, once the user's code has imported Dynamo (``import
    accel_ctx`` and the scopes never import it)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    stock = getattr(optimized, "__dict__", {}).get("__call__")
    if (stock is None or not isinstance(getattr(eval_frame, "_in_optimized_module", None), bool)
            or "_set_in_optimized_module" not in getattr(stock, "__code__", stock).co_names):
        return []  # torch changed: its own __call__ stays
    if _replacements.is_ours(stock):
        return []  # in place already
    return [_AttributePatch(optimized, "__call__",
                            _replacements.optimized_module_call_for(stock, eval_frame))]


# ------------------------------------------------------------------------------------------------
# gradient clipping
# ------------------------------------------------------------------------------------------------
def _routed(stock: Any, scoped: Callable[..., Any]) -> Any:
    def gate(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if _state.current() is None:
            return wrapped(*args, **kwargs)
        return scoped(*args, **kwargs)

    return wrapt.FunctionWrapper(stock, gate)
