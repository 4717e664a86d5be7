"""DDP's own controls, used on an adopted model: a script moved from DDP keeps working.

accel_ctx hands the user's own module back instead of a ``DistributedDataParallel`` wrapper, so
the DDP attributes a script uses land on that module:

* ``model.require_backward_grad_sync = False`` (nanoGPT's micro-steps) is an attribute of the
  user's module; each top-level forward reads it, as DDP reads its own flag in ``forward``: False
  skips the gradient all-reduce of that forward's backward.
* ``with model.no_sync():`` does what DDP's does: forwards inside it skip the all-reduce; the
  first forward after it synchronises the accumulated sum.
* ``model.module`` (``model.module.state_dict()``) raises an ``AttributeError`` that says there
  is no wrapper and to use ``model`` itself (``hasattr(model, "module")`` stays False, so
  ``getattr(model, "module", model)`` keeps working).

These answers come from torch's ``nn.Module.__getattr__`` (patched in ``_hooks.patches``), which runs
only when the normal lookup fails, and only while a scope of this thread is open: a module that
defines such a name itself, and every module outside the scopes, behave as in torch.
"""

from __future__ import annotations

import sys
import weakref
from types import TracebackType
from typing import Any

from torch import nn

from .._kernel import state as _state
from . import touch as _touch

# id(module) -> (module, nesting depth of its no_sync() blocks); an entry goes with its module
_paused: dict[int, tuple[weakref.ref[nn.Module], int]] = {}


def holds_back(module: nn.Module) -> bool:
    """Whether the backward of ``module``'s forward now must skip the gradient all-reduce."""
    if module.__dict__.get("require_backward_grad_sync", True) is False:
        return True
    entry = _paused.get(id(module))
    return entry is not None and entry[0]() is module


class NoSync:
    """``model.no_sync()`` on an adopted model: DDP's ``no_sync`` for forwards inside."""

    def __init__(self, module: nn.Module) -> None:
        self._module = weakref.ref(module)

    def __enter__(self) -> None:
        module = self._module()
        if module is None:
            return
        key = id(module)
        entry = _paused.get(key)
        if entry is not None and entry[0]() is module:
            _paused[key] = (entry[0], entry[1] + 1)
            return

        def gone(ref: weakref.ref[nn.Module]) -> None:
            if (now := _paused.get(key)) is not None and now[0] is ref:
                del _paused[key]

        _paused[key] = (weakref.ref(module, gone), 1)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        module = self._module()
        entry = _paused.get(id(module)) if module is not None else None
        if module is None or entry is None or entry[0]() is not module:
            return
        if entry[1] <= 1:
            del _paused[id(module)]
        else:
            _paused[id(module)] = (entry[0], entry[1] - 1)


def _no_wrapper(module: nn.Module) -> AttributeError:
    name = type(module).__name__
    return AttributeError(
        f"'{name}' object has no attribute 'module': accel_ctx does not wrap your model, so "
        f"there is no DistributedDataParallel around it and no .module inside. Use the model "
        f"itself: model.state_dict() has the keys model.module.state_dict() has under DDP (no "
        f"'module.' prefix), and torch.save(model) saves your {name}. In code that runs both "
        "ways, getattr(model, 'module', model) gives the model in either case.")


def missing_attribute(module: nn.Module, name: str) -> Any:
    """What ``module.<name>`` gives when torch's lookup found nothing (else AttributeError)."""
    if _state.current() is not None and name in _touch.fsdp_names():
        # FSDP2's methods before the model's first touch: shard it now, as fully_shard would
        # have (frames: this one, nn.Module.__getattr__, the line that asked)
        return _touch.fsdp_attribute(module, name, sys._getframe(2))
    if name in ("module", "no_sync", "require_backward_grad_sync") and _state.current() is not None:
        if name == "module":
            raise _no_wrapper(module)
        if name == "no_sync":
            return lambda: NoSync(module)
        return True  # DDP's default: the next backward synchronises
    raise AttributeError(f"'{type(module).__name__}' object has no attribute '{name}'")
