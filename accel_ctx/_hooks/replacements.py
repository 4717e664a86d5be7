"""The functions the scoped patches install in place of torch's hot entry points.

``_hooks.patches`` installs and removes them; here is what runs instead: ``nn.Module.__call__``
(one ContextVar read per call, the gates for a top-level call), ``nn.Module.__getattr__``
(torch's own body; a miss asks ``_engines.ddp_controls``), ``Tensor.backward`` (the gate under
torch's name) and ``torch.compile``'s ``OptimizedModule.__call__``. Each is made once per stock
function for the life of the process.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

from torch import nn

from .._engines import ddp_controls as _ddp_controls
from .._kernel import state as _state
from . import gates as _gates
from . import tracing as _tracing

# ------------------------------------------------------------------------------------------------
# made once per process
# ------------------------------------------------------------------------------------------------
# One replacement per stock function for the life of the process: a compiled graph guards on
# the __call__ and __getattr__ it traced, so a new scope must not bring new ones (a recompile).
_replacements: dict[tuple[str, Any], Callable[..., Any]] = {}


def is_ours(function: Any) -> bool:
    """Whether ``function`` is one of the replacements made here (a patch in place)."""
    return any(function is made for made in _replacements.values())


def _made_once(name: str, stock: Any, make: Callable[[], Callable[..., Any]]
               ) -> Callable[..., Any]:
    """The replacement of ``stock`` (the entry point ``name``), made by ``make`` the first time."""
    key = (name, stock)
    if key not in _replacements:
        _replacements[key] = make()
    return _replacements[key]


def module_call_for(stock: Any) -> Callable[..., Any]:
    """What replaces ``nn.Module.__call__`` (``stock``)."""
    return _made_once("__call__", stock, lambda: _make_module_call(stock))


def tensor_backward_for(stock: Any) -> Callable[..., Any]:
    """What replaces ``torch.Tensor.backward`` (``stock``)."""
    return _made_once("backward", stock, lambda: _make_tensor_backward(stock))


def module_getattr_for(stock: Any) -> Callable[..., Any]:
    """What replaces ``nn.Module.__getattr__`` (``stock``)."""
    return _made_once("__getattr__", stock, lambda: _make_module_getattr(stock))


def optimized_module_call_for(stock: Any, eval_frame: Any) -> Callable[..., Any]:
    """What replaces ``torch.compile``'s ``OptimizedModule.__call__`` (``stock``; Dynamo loaded)."""
    return _made_once("OptimizedModule.__call__", stock,
                      lambda: _make_optimized_module_call(stock, eval_frame))


def _make_tensor_backward(stock: Any) -> Callable[..., Any]:
    # the gate's own code under torch's name, signature and docstring: no extra frame
    gate = _gates.tensor_backward
    backward = types.FunctionType(gate.__code__, gate.__globals__, "backward",
                                  gate.__defaults__, gate.__closure__)
    return functools.update_wrapper(backward, stock)


# ------------------------------------------------------------------------------------------------
# nn.Module.__call__: the hot path
# ------------------------------------------------------------------------------------------------
def _make_module_call(stock: Any) -> Callable[..., Any]:
    # read_stack: the one object _hooks.tracing teaches Dynamo to trace
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
# torch.compile(model).__call__: the compiled model DDP's engine calls for the user's call of it
# ------------------------------------------------------------------------------------------------
def _make_optimized_module_call(stock: Any, eval_frame: Any) -> Callable[..., Any]:
    optimized = eval_frame.OptimizedModule
    has_global_hook: Callable[[], bool] = nn.modules.module._has_any_global_hook

    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        # A compiled model called while a compiled model's call is under way: DDP's engine
        # calling the model the user called (the gates routed that call to it), every step.
        # torch's own __call__ would set the flag that is set already, through a context
        # manager (four Python calls); with global hooks it warns, so it runs as it is.
        if eval_frame._in_optimized_module and not has_global_hook():
            return super(optimized, self).__call__(*args, **kwargs)
        return stock(self, *args, **kwargs)

    __call__.__wrapped__ = stock  # type: ignore[attr-defined]
    __call__.__doc__ = getattr(stock, "__doc__", None)
    __call__.__qualname__ = "OptimizedModule.__call__"
    _tracing.skip_as_a_frame(__call__)  # as torch's own: Dynamo skips its files
    return __call__
