"""Gradient clipping that knows about accumulation and fp16 loss scaling.

Inside a scope, ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` are routed here too,
so an unchanged loop clips correctly. Under fp16 the gradients are unscaled first (through the
GradScaler, once per step, however often clipping is called), as torch's recipe does with
``scaler.unscale_(opt)``: the inf/NaN check runs before clipping, so clipping can never turn an
overflowed step into one that is applied. Gradients whose optimizer accel_ctx has not met yet
(clipping before the first ``opt.step()``) are unscaled the same way, and their check counts
for the optimizer that steps them. Under ``accumulate()`` nothing is clipped before the group's
last micro-step: the call then returns the norm of the gradients accumulated so far and leaves
them alone.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Any

import torch
from torch.nn.utils import clip_grad as _stock
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from .._kernel import state as _state
from .._options import checked, flag
from ..errors import ConfigurationError

_Params = torch.Tensor | Iterable[torch.Tensor]
# Captured at import, before any scope patches torch's names with ours.
_stock_clip_norm = _stock.clip_grad_norm_
_stock_clip_value = _stock.clip_grad_value_


def _check(call: str, name: str, value: object) -> None:
    """A bound or norm order as torch takes it: a number, a one-element tensor, or (norm
    orders) a string such as 'inf'; a bool or another string is refused, not guessed at."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if isinstance(value, torch.Tensor):
        ok = value.numel() == 1
    elif isinstance(value, str) and name == "norm_type":
        try:
            float(value)
            ok = True
        except ValueError:
            ok = False
    if not ok:
        raise ConfigurationError(
            f"{call}({name}={value!r}): give a number" + (" (or 'inf')" if name == "norm_type"
                                                          else "") + ".")


def _as_list(parameters: _Params) -> list[torch.Tensor]:
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    return list(parameters)


def _split_scaled(
    stack: _state.Stack, params: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor], float]:
    """Unscale what can be; return (unscaled grads, still-scaled grads, scale)."""
    for grads_of in stack.hooks.grads_for_clipping:  # fp16: unscaled through the GradScaler
        found = grads_of(stack.session, params)
        if found is not None:
            return found
    return [p.grad for p in params if p.grad is not None], [], 1.0


def _deferred(stack: _state.Stack) -> bool:
    """Mid accumulation group: clipping now would clip a partial sum."""
    return any(defers() for defers in stack.hooks.defers_clipping)


def _loss_scale(stack: _state.Stack) -> torch.Tensor | float:
    """The scale as the device holds it: dividing by it waits for nothing."""
    for concern in stack.concerns:
        scaling = concern.loss_scaling()
        if scaling is not None:
            return scaling.current_scale()
    return 1.0


def _total_norm(
    plain: list[torch.Tensor], scaled: list[torch.Tensor], scale: torch.Tensor | float,
    norm_type: float,
    foreach: bool | None,
) -> torch.Tensor:
    norms = []
    for group in _by_mesh(plain):
        norms.append(_whole(get_total_norm(group, norm_type, False, foreach)))
    for group in _by_mesh(scaled):
        norms.append(_whole(get_total_norm(group, norm_type, False, foreach)) / scale)
    if not norms:
        return torch.tensor(0.0)
    if len(norms) == 1:
        return norms[0]
    stacked = torch.stack([n.to(norms[0].device) for n in norms])
    total: torch.Tensor = torch.linalg.vector_norm(stacked, norm_type)
    return total


def _by_mesh(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The tensors grouped by device mesh (plain ones together): torch's norm and clip refuse
    DTensors of different meshes in one call (tensor parallelism's 2-D parameters beside the
    ones the plan left on the data-parallel mesh)."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(getattr(tensor, "device_mesh", None), []).append(tensor)
    return list(groups.values())


def _whole(norm: torch.Tensor) -> torch.Tensor:
    """The norm over every rank's shard when the gradients are sharded (a DTensor norm holds
    partial sums until reduced); a plain tensor as it is."""
    full_tensor = getattr(norm, "full_tensor", None)
    return full_tensor() if full_tensor is not None else norm


@checked
def clip_grad_norm_(
    parameters: _Params,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip the gradient norm like ``torch.nn.utils.clip_grad_norm_``, correct in every scope.

    Under fp16 the gradients are unscaled first; under ``accumulate()`` clipping waits for the
    group's last micro-step (earlier calls return the running norm and change nothing); under
    ``distributed()`` the gradients are already averaged, so every rank clips alike. Outside a
    scope it is torch's function.

    Examples:
        >>> import torch
        >>> from accel_ctx import clip_grad_norm_
        >>> w = torch.nn.Parameter(torch.ones(3))
        >>> (w * 10).sum().backward()
        >>> round(float(clip_grad_norm_([w], max_norm=1.0)), 3)
        17.321
    """
    _check("clip_grad_norm_", "max_norm", max_norm)
    _check("clip_grad_norm_", "norm_type", norm_type)
    flag("clip_grad_norm_", "error_if_nonfinite", error_if_nonfinite)
    if foreach is not None:
        flag("clip_grad_norm_", "foreach", foreach)
    stack = _state.current()
    if stack is None:
        return _stock_clip_norm(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
    params = _as_list(parameters)
    norm_type = float(norm_type)
    if _deferred(stack):
        grads = [p.grad for p in params if p.grad is not None]
        return _total_norm([], grads, _loss_scale(stack), norm_type, foreach)
    for clips in stack.hooks.clips_in_step:  # DeepSpeed: the gradients are reduced there
        later = clips(float(max_norm), norm_type)
        if later is not None:
            return later
    plain, scaled, scale = _split_scaled(stack, params)
    total = _total_norm(plain, scaled, scale, norm_type, foreach)
    job = _state.current_job()
    if job is not None and job.coordinates.pp_size > 1:  # each stage holds its part of them
        from .._engines.pipeline import whole_norm

        total = whole_norm(job, total, norm_type)
    if error_if_nonfinite and (total.isnan() or total.isinf()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
            "by the non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    if plain or scaled:
        for group in _by_mesh([p for p in params if p.grad is not None]):
            clip_grads_with_norm_(group, max_norm, total, foreach)
    return total


@checked
def clip_grad_value_(
    parameters: _Params, clip_value: float, foreach: bool | None = None
) -> None:
    """Clamp gradients like ``torch.nn.utils.clip_grad_value_``, correct in every scope.

    Examples:
        >>> import torch
        >>> from accel_ctx import clip_grad_value_
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> (w * 5).sum().backward()
        >>> clip_grad_value_([w], 1.0); w.grad
        tensor([1., 1.])
    """
    _check("clip_grad_value_", "clip_value", clip_value)
    if foreach is not None:
        flag("clip_grad_value_", "foreach", foreach)
    stack = _state.current()
    if stack is None:
        _stock_clip_value(parameters, clip_value, foreach)
        return
    if _deferred(stack):
        return
    if stack.hooks.clips_in_step:
        raise ConfigurationError(
            "clip_grad_value_ under sharded(engine='deepspeed'): DeepSpeed reduces the "
            "gradients inside opt.step() and clips only by norm there; use "
            "clip_grad_norm_(model.parameters(), max_norm) instead.")
    params = _as_list(parameters)
    plain, scaled, scale = _split_scaled(stack, params)
    value = float(clip_value)
    for grad in plain:
        grad.clamp_(-value, value)
    for grad in scaled:
        grad.clamp_(-value * scale, value * scale)

