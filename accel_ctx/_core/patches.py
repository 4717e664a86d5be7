"""Scoped patches: installed with the first scope, gated per call, undone with the last.

Every patched entry point first reads the ContextVar; with no scope of this thread and process
it is the stock function. Otherwise the call site runs the hooks of the open concerns
(``_core.concern.Concern``) in their order; what each concern does lives in its own module.

Intercepted: ``nn.Module.__call__`` (top-level calls only), ``nn.Module.__getattr__`` (its misses
only: DDP's names on an adopted model, ``_engines.ddp_controls``), ``Tensor.backward``,
``DataLoader.__iter__``/``__len__`` (and the index sampler its iterator reads),
``Optimizer.step`` (through torch's global step hooks, so every call path is seen; the
``chain`` of ``torch.optim.optimizer``'s hook loops, so a held-back step runs no hook),
``Optimizer.zero_grad``, ``Module.zero_grad``, ``LRScheduler.step`` and subclasses defining
their own, ``torch.nn.utils.clip_grad_norm_``/``clip_grad_value_``, and ``GradScaler``'s
``scale``/``unscale_``/``step``/``update``/``get_scale`` (a user's own defers to an fp16
scope's), and ``set_epoch`` of every Sampler and Dataset class defining it (a call the loop makes
itself marks the object as driven by the loop).
Not intercepted: ``torch.autograd.backward``/``autograd.grad``, DataLoader subclasses that
override ``__iter__``, classes defined after the first scope opened, and names bound with
``from torch.nn.utils import clip_grad_norm_`` before it opened (use ``accel_ctx``'s own).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import types
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
from .._engines import ddp_controls as _ddp_controls
from .._precision import user_scaler as _user_scaler
from .._steps import clip as _clip
from ..errors import PatchConflictError
from . import gates as _gates
from . import state as _state
from . import step_gates as _step_gates
from . import tracing as _tracing

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
    global _users, _lock
    _lock = threading.RLock()  # the parent's may have been held by a thread that is gone
    if _users:
        _users = 0
        with contextlib.suppress(PatchConflictError):
            _uninstall()


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
    module_call = _module_call_for(_gates.stock.module_call)
    _tracing.installing(module_call)
    patches = [
        _AttributePatch(nn.Module, "__call__", module_call),
        _AttributePatch(nn.Module, "__getattr__", _module_getattr_for(nn.Module.__dict__["__getattr__"])),
        _AttributePatch(_optim_module, "chain", _step_gates.HookChain),
        _AttributePatch(torch.Tensor, "backward", _tensor_backward_for(_gates.stock.backward)),
        _wrap(DataLoader, "__iter__", _gates.loader_iter),
        _wrap(DataLoader, "__len__", _gates.loader_len),
        _AttributePatch(DataLoader, INDEX_SAMPLER, index_sampler_property(_data.building_view)),
        _wrap(nn.Module, "zero_grad", _step_gates.zero_grad),
    ]
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
    try:
        for patch in patches:
            patch.install()
            _undo.append(patch.uninstall)
        pre = _optim_module.register_optimizer_step_pre_hook(_step_gates.before_step)
        _undo.append(pre.remove)
        _run_first(_optim_module._global_optimizer_pre_hooks, pre.id)
        post = _optim_module.register_optimizer_step_post_hook(_step_gates.after_step)
        _undo.append(post.remove)
    except BaseException:
        _uninstall()
        raise


def _run_first(hooks: dict[int, Any], key: int) -> None:
    """Make the hook under ``key`` the first of ``hooks``: a held-back step() then runs no
    other hook (``_core.step_gates.HookChain``)."""
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
# nn.Module.__call__: the hot path
# ------------------------------------------------------------------------------------------------
# One replacement per stock function for the life of the process: a compiled graph guards on
# the __call__ and __getattr__ it traced, so a new scope must not bring new ones (a recompile).
_replacements: dict[tuple[str, Any], Callable[..., Any]] = {}


def _module_call_for(stock: Any) -> Callable[..., Any]:
    key = ("__call__", stock)
    if key not in _replacements:
        _replacements[key] = _make_module_call(stock)
    return _replacements[key]


def _tensor_backward_for(stock: Any) -> Callable[..., Any]:
    key = ("backward", stock)
    if key not in _replacements:
        # the gate's own code under torch's name, signature and docstring: no extra frame
        gate = _gates.tensor_backward
        backward = types.FunctionType(gate.__code__, gate.__globals__, "backward",
                                      gate.__defaults__, gate.__closure__)
        _replacements[key] = functools.update_wrapper(backward, stock)
    return _replacements[key]


def _module_getattr_for(stock: Any) -> Callable[..., Any]:
    key = ("__getattr__", stock)
    if key not in _replacements:
        _replacements[key] = _make_module_getattr(stock)
    return _replacements[key]


def _make_module_call(stock: Any) -> Callable[..., Any]:
    # read_stack: the one object _core.tracing teaches Dynamo to trace
    get_stack = _state.read_stack
    code = getattr(stock, "__code__", None)
    if stock is nn.Module._wrapped_call_impl and code is not None and code.co_names == (
        "_compiled_call_impl",
        "_call_impl",
    ):
        # Same two lines as torch's _wrapped_call_impl, plus one ContextVar read: calling
        # through to the stock function would add a Python frame to every submodule call.
        def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            stack = get_stack()
            if stack is not None and not stack.in_forward:
                return _gates.top_level_call(stack, self, args, kwargs)
            if self._compiled_call_impl is not None:
                return self._compiled_call_impl(*args, **kwargs)
            return self._call_impl(*args, **kwargs)  # type: ignore[no-untyped-call]

    else:  # torch changed, or another library patched __call__ first: wrap what is there

        def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            stack = get_stack()
            if stack is not None and not stack.in_forward:
                return _gates.top_level_call(stack, self, args, kwargs)
            return stock(self, *args, **kwargs)

    __call__.__wrapped__ = stock  # type: ignore[attr-defined]
    __call__.__doc__ = getattr(stock, "__doc__", None)
    return __call__


# ------------------------------------------------------------------------------------------------
# nn.Module.__getattr__: every parameter, buffer and submodule read goes through it
# ------------------------------------------------------------------------------------------------
_STOCK_GETATTR_NAMES = ("__dict__", "AttributeError", "type", "__name__")


def _make_module_getattr(stock: Any) -> Callable[..., Any]:
    """torch's lookup unchanged; a miss asks ``_engines.ddp_controls`` (DDP's names on an adopted model)."""
    missing = _ddp_controls.missing_attribute
    code = getattr(stock, "__code__", None)
    if code is not None and code.co_names == _STOCK_GETATTR_NAMES:
        # torch's own body, line for line, so that the hot path costs what it did
        def __getattr__(self: nn.Module, name: str) -> Any:
            if "_parameters" in self.__dict__:
                _parameters = self.__dict__["_parameters"]
                if name in _parameters:
                    return _parameters[name]
            if "_buffers" in self.__dict__:
                _buffers = self.__dict__["_buffers"]
                if name in _buffers:
                    return _buffers[name]
            if "_modules" in self.__dict__:
                modules = self.__dict__["_modules"]
                if name in modules:
                    return modules[name]
            return missing(self, name)

    else:  # torch changed, or another library patched __getattr__ first: ask it first

        def __getattr__(self: nn.Module, name: str) -> Any:
            try:
                return stock(self, name)
            except AttributeError:
                return missing(self, name)

    __getattr__.__wrapped__ = stock  # type: ignore[attr-defined]
    __getattr__.__doc__ = getattr(stock, "__doc__", None)
    __getattr__.__qualname__ = "Module.__getattr__"
    return __getattr__


# ------------------------------------------------------------------------------------------------
# gradient clipping
# ------------------------------------------------------------------------------------------------
def _routed(stock: Any, scoped: Callable[..., Any]) -> Any:
    def gate(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if _state.current() is None:
            return wrapped(*args, **kwargs)
        return scoped(*args, **kwargs)

    return wrapt.FunctionWrapper(stock, gate)
