"""A user's own GradScaler inside ``mixed_precision("fp16")``: it defers to the scope's.

An AMP loop kept as it was (``scaler.scale(loss).backward(); scaler.step(opt);
scaler.update()``) inside an fp16 scope would scale the loss twice: its fp16 gradients overflow
at every step and the user's scaler skips step after step while its scale comes down. The
patches of ``GradScaler``'s methods route here: a user's enabled scaler then behaves as a
disabled one would, and the scope's loss scaling does the work once, as in torch's recipe. The
scope's own GradScaler (marked by ``_precision.loss_scale``) and any scaler outside an fp16 scope run as
torch wrote them. Inside ``mixed_precision("fp16-true")`` the gradients are fp16, which torch's
GradScaler refuses to unscale: its ``ValueError`` becomes an error naming the scope and the fix.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from .._kernel import state as _state
from .._kernel.concern import LossScaling
from .._precision.loss_scale import OWN_SCALER
from .._warn import warn_user
from ..errors import ConfigurationError
from . import step_gates as _step_gates

# Users' own GradScalers told once that they defer to a mixed_precision("fp16") scope's.
_deferring: weakref.WeakSet[Any] = weakref.WeakSet()
_deferring_lock = threading.Lock()


def _first_deferral(scaler: Any) -> bool:
    """True the first time ``scaler`` (a user's GradScaler) defers to a scope's loss scaling."""
    with _deferring_lock:
        if scaler in _deferring:
            return False
        _deferring.add(scaler)
        return True


def _deferring_to(scaler: Any) -> LossScaling | None:
    """The scope's fp16 loss scaling when ``scaler`` is a user's own enabled GradScaler."""
    stack = _state.current()
    if stack is None or scaler.__dict__.get(OWN_SCALER) or not scaler.is_enabled():
        return None
    for concern in stack.concerns:
        scaling = concern.loss_scaling()
        if scaling is not None:
            if _first_deferral(scaler):
                warn_user(
                    "A GradScaler of your own runs inside mixed_precision('fp16'), which scales "
                    "the loss itself: yours now defers to it (scale() returns the loss as it "
                    "is, step() calls opt.step(), unscale_() unscales through the scope, "
                    "update() does nothing), so the loss is scaled once, as in torch's recipe. "
                    "You can remove it, or use mixed_precision('no') to keep your own AMP code.")
            return scaling
    return None


def _run(wrapped: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A user's GradScaler method as torch wrote it; under 'fp16-true' its refusal of fp16
    gradients says why they are fp16 and what to do instead."""
    try:
        return wrapped(*args, **kwargs)
    except ValueError as error:
        stack = _state.current()
        # by the protocol, as state() reads it (checkpoints may not import the runtimes)
        if "FP16 gradients" not in str(error) or stack is None or not any(
                c.snapshot().get("mixed_precision") == "fp16-true" for c in stack.concerns):
            raise
        raise ConfigurationError(
            "A GradScaler of your own runs inside mixed_precision('fp16-true'), which keeps the "
            "model and its gradients in fp16 with no loss scaling, and torch's GradScaler cannot "
            "unscale fp16 gradients. Remove the GradScaler (scaler.scale(loss).backward() -> "
            "loss.backward(), scaler.step(opt) -> opt.step(), no scaler.update()), or use "
            "mixed_precision('fp16') (fp32 weights, autocast and loss scaling: your scaler then "
            "defers to the scope's) or 'bf16-true' (fp32's range, no scaling needed).") from error


def _first(args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
    return args[0] if args else kwargs[name]


def scale(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> Any:
    if _deferring_to(instance) is None:
        return wrapped(*args, **kwargs)
    return _first(args, kwargs, "outputs")  # loss.backward() scales it, once


def unscale(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                   ) -> Any:
    scaling = _deferring_to(instance)
    if scaling is None:
        return _run(wrapped, args, kwargs)
    optimizer = _first(args, kwargs, "optimizer")
    stack = _state.current()
    if stack is not None:
        _step_gates.optimizer_record(stack, optimizer)  # known from now on: clipping unscales nothing twice
    scaling.unscale(optimizer)  # gradients read next: unscaled
    return None


def step(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                ) -> Any:
    if _deferring_to(instance) is None:
        return _run(wrapped, args, kwargs)
    rest = dict(kwargs)
    optimizer = args[0] if args else rest.pop("optimizer")
    return optimizer.step(*args[1:], **rest)  # the step hooks unscale and skip on overflow


def update(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                  ) -> Any:
    if _deferring_to(instance) is None:
        return wrapped(*args, **kwargs)
    return None  # the scope updates its scale before the next backward


def get_scale(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                     ) -> Any:
    scaling = _deferring_to(instance)
    if scaling is None:
        return wrapped(*args, **kwargs)
    return float(scaling.current_scale())  # the scale in use (waits for the device, as torch's)
