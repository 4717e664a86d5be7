"""What runs inside the patched entry points while a scope is open: the open concerns' hooks.

``_hooks.patches`` installs these gates (and the stock functions they fall back to) with the first
scope; each gate runs the hooks of the stack's concerns (``_kernel.concern.Concern``) in their order.
Here: a top-level module call, ``Tensor.backward`` (counting backward passes) and
``DataLoader`` iteration; the optimizer's and LR schedulers' gates are ``_hooks.step_gates``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import wrapt
from torch import nn

from .._data import iterate as _data
from .._engines import ddp_keys as _ddp_keys
from .._kernel import state as _state
from .._kernel.concern import NOT_FAST, ForwardCall
from . import tracing as _tracing

_get_ident = threading.get_ident
_grad_enabled = torch.is_grad_enabled
_in_backward = _state.IN_BACKWARD.get
_read_stack = _state.read_stack


def _not_installed(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("accel_ctx's patches are not installed: no stock function was captured")


class _Stock:
    """torch's own functions, captured when the patches are installed."""

    def __init__(self) -> None:
        self.module_call: Callable[..., Any] = _not_installed  # nn.Module.__call__
        self.backward: Callable[..., Any] = _not_installed  # torch.Tensor.backward


stock = _Stock()


def module_device_type(module: nn.Module) -> str:
    for p in module.parameters():
        return p.device.type
    return "cpu"


def _compiler_graph(module: nn.Module) -> bool:
    """A graph the compiler made, called by compiled code (AOT autograd's graphs under the
    debugging backends): the user's model's parameters are its inputs, not its own. Not a
    model of the user's: torch's own call, as outside any scope."""
    return isinstance(module, _GraphModule) and next(module.parameters(), None) is None


_GraphModule = torch.fx.GraphModule
_NO_CONTEXTS: list[AbstractContextManager[Any]] = []


def top_level_call(
    stack: _state.Stack, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """A module called outside any adopted forward: the open concerns shape and wrap the call."""
    # hot path (once per training step): the state module's checks inlined, no call per check
    if (stack.pid != _state._pid or stack.thread != _get_ident()
            or (isinstance(module, _GraphModule) and _compiler_graph(module))):
        return stock.module_call(module, *args, **kwargs)
    if not _tracing.registered:  # the user's code may have imported Dynamo since the scope opened
        _tracing.register_if_dynamo_loaded()
    hooks = stack.hooks
    if hooks.fast_forward is not None:  # one runtime shapes the call: its whole part at once
        out = hooks.fast_forward(stack, module, args, kwargs)
        if out is not NOT_FAST:
            return out
    call = ForwardCall(module, args, kwargs, _grad_enabled())
    for before in hooks.before_forward:  # picks the engine (a broadcast from rank 0 at first)
        before(call, stack.session)
    engine = call.engine
    # only a change goes through nn.Module.__setattr__ (a Python function: costly per step)
    if engine is not None and call.grad and call.sync is not None \
            and engine.require_backward_grad_sync is not call.sync:
        engine.require_backward_grad_sync = call.sync
    if hooks.forward_context and call.device_type is None:
        call.device_type = module_device_type(module)
    try:
        contexts = ([c for h in hooks.forward_context if (c := h(call)) is not None]
                    if hooks.forward_context else _NO_CONTEXTS)
        token = _state.set_stack(stack.forward)  # inside a forward: submodules run stock
        try:
            out = run(call, contexts) if contexts else stock.module_call(
                call.target, *call.args, **call.kwargs)
        finally:
            _state.reset_stack(token)
        for after in hooks.after_forward:
            out = after(call, out)
        return out
    except Exception as exc:
        for failed in hooks.forward_failed:
            failed(call, exc)
        raise
    finally:
        for done in hooks.forward_done:
            done(call)


def run(call: ForwardCall, contexts: list[AbstractContextManager[Any]]) -> Any:
    """Call the target in ``contexts``, through torch's own ``nn.Module.__call__``: the user's
    call of the module already ran its class's own ``__call__`` (``torch.compile``'s wrapper, a
    subclass's), which must not run twice; an engine (DDP) defines none."""
    target, args, kwargs = call.target, call.args, call.kwargs
    if not contexts:
        return stock.module_call(target, *args, **kwargs)
    if len(contexts) == 1:
        with contexts[0]:
            return stock.module_call(target, *args, **kwargs)
    with contextlib.ExitStack() as exits:
        for context in contexts:
            exits.enter_context(context)
        return stock.module_call(target, *args, **kwargs)


# ------------------------------------------------------------------------------------------------
# Tensor.backward
# ------------------------------------------------------------------------------------------------
def params_in_play(stack: _state.Stack) -> list[torch.Tensor]:
    params = {id(p): p for p in stack.session.params_in_play()}
    if stack.job is not None:
        for module in list(stack.job.adoption.modules):
            params.update((id(p), p) for p in module.parameters())
    return list(params.values())


def tensor_backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """``Tensor.backward`` while a scope is open (installed as it, a plain function: a wrapt
    wrapper makes a bound wrapper and a bound method at every call)."""
    stack = _read_stack()  # _state.current(), inlined: once per step
    if stack is not None and (stack.pid != _state._pid or stack.thread != _get_ident()):
        stack = None
    if stack is None or _in_backward():
        return stock.backward(loss, *args, **kwargs)
    session = stack.session
    hooks = stack.hooks
    for before in hooks.before_backward:
        loss = before(loss, session)
    # Tensor subclasses dispatch backward through __torch_function__ back to this patch.
    token = _state.IN_BACKWARD.set(True)
    try:
        contexts = ([c for h in hooks.backward_context if (c := h()) is not None]
                    if hooks.backward_context else _NO_CONTEXTS)
        if not contexts:
            result = stock.backward(loss, *args, **kwargs)
        elif len(contexts) == 1:
            with contexts[0]:
                result = stock.backward(loss, *args, **kwargs)
        else:
            with contextlib.ExitStack() as exits:
                for context in contexts:
                    exits.enter_context(context)
                result = stock.backward(loss, *args, **kwargs)
    except Exception as exc:
        for failed in hooks.backward_failed:
            failed(exc)
        raise
    finally:
        _state.IN_BACKWARD.reset(token)
    session.backward_calls += 1
    if hooks.after_backward:
        params = functools.partial(params_in_play, stack)
        for after in hooks.after_backward:
            after(session, params)
    return result


# ------------------------------------------------------------------------------------------------
# DataLoader
# ------------------------------------------------------------------------------------------------
def module_touch(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``model.parameters()``, ``state_dict()`` & co.: a touch before the first forward lays the
    model out as training will (``_engines.touch``), then torch's own method runs."""
    stack = _state.current()
    if stack is not None and stack.hooks.before_touch:
        module = instance if isinstance(instance, nn.Module) else (args[0] if args else None)
        if isinstance(module, nn.Module):
            caller = sys._getframe(1)
            while caller.f_back is not None and caller.f_code.co_filename.startswith(_WRAPT):
                caller = caller.f_back  # wrapt's pure-Python fallback, if it runs
            for hook in stack.hooks.before_touch:
                hook(module, stack.session, caller)
    if stack is not None and stack.job is not None and wrapped.__name__ == "load_state_dict" \
            and isinstance(instance, nn.Module):
        _ddp_keys.refuse_wrapped_keys(instance, args, kwargs)
    return wrapped(*args, **kwargs)


_WRAPT = os.path.dirname(wrapt.__file__)


def loader_iter(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    stack = _state.current()
    if stack is None:
        return wrapped(*args, **kwargs)
    return _data.scoped_iter(stack, instance, wrapped)


def loader_len(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    stack = _state.current()
    if stack is None:
        return wrapped(*args, **kwargs)
    return _data.scoped_len(stack, instance, wrapped)
