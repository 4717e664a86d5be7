"""fp16 loss scaling for ``mixed_precision("fp16")``, done by ``torch.amp.GradScaler``.

``loss.backward()`` scales, ``opt.step()`` unscales, checks for inf/NaN and the step is skipped
when needed. An optimizer whose fused kernel takes GradScaler's scale and inf flag (fused Adam,
AdamW, SGD) gets them as ``GradScaler.step`` hands them over: it unscales and skips on the
device, and nothing waits for the device to learn whether the step was skipped. The scale is
updated once per iteration, just before the next scaled backward (or when the scope ends), so several optimizers stepping on one backward all unscale with the scale
their gradients were made with. This is the one place a GradScaler is built: at the first
scaled backward, on the loss's device (a checkpoint's scaler state waits for it).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, cast

import torch
from torch.amp.grad_scaler import OptState

from .._kernel.session import Session

OWN_SCALER = "_accel_ctx_scaler"
"""Marks the GradScaler a scope runs, which the GradScaler patches leave alone."""


class _GradGroup:
    """Parameters posing as an optimizer for ``GradScaler.unscale_`` (it reads param_groups).

    Clipping can come before accel_ctx has met the optimizer that owns the gradients (a loop
    whose first ``opt.step()`` follows the first clip): they are unscaled through the scaler
    under this stand-in, so clipping sees unscaled gradients and the inf/NaN check happens
    before clipping could hide an overflow.
    """

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.param_groups = [{"params": params}]


class LossScaler:
    """The GradScaler of one fp16 scope, and when to update it."""

    def __init__(self, init_scale: float, growth_interval: int) -> None:
        self.init_scale = init_scale
        self.growth_interval = growth_interval
        self.scaler: torch.amp.GradScaler | None = None
        self.pending_update = False
        self._loaded: dict[str, Any] | None = None  # a checkpoint's state, for the next scaler
        # Parameters unscaled before their optimizer was known (id -> the stand-in used).
        self._early: dict[int, _GradGroup] = {}
        # Optimizers holding the scale and inf flag handed over for their fused step.
        self._handed: list[torch.optim.Optimizer] = []

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        self.flush()
        self._forget_early()
        if self.scaler is None:
            self.scaler = torch.amp.GradScaler(
                loss.device.type, init_scale=self.init_scale,
                growth_interval=self.growth_interval)
            self.scaler.__dict__[OWN_SCALER] = True  # a user's GradScaler defers; ours does not
            if self._loaded is not None:
                self.scaler.load_state_dict(self._loaded)
                self._loaded = None
        return self.scaler.scale(loss)

    def _optimizer_state(self, optimizer: object) -> dict[str, Any] | None:
        if self.scaler is None or not self.scaler.is_enabled():
            return None
        # GradScaler keeps its per-optimizer stage and inf flags here; reading them lets the
        # step hook decide without calling GradScaler.step (which would re-enter opt.step).
        states: dict[int, dict[str, Any]] = self.scaler._per_optimizer_states
        return states[id(optimizer)]

    def unscale(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale ``optimizer``'s gradients once per iteration; False if nothing is scaled."""
        state = self._optimizer_state(optimizer)
        if state is None:
            return False
        if state["stage"] is OptState.READY:
            assert self.scaler is not None
            if self._early and self._owns_early(optimizer):
                self._unscale_rest(optimizer, state)
            else:
                self.scaler.unscale_(optimizer)
        return True

    def unscale_params(self, params: list[torch.Tensor]) -> bool:
        """Unscale the gradients of ``params``, whose optimizer is not known yet, once per step.

        The overflow check runs here, before any clipping, and counts for the optimizer that
        steps them (:meth:`unscale` merges it). False if nothing is scaled.
        """
        if self.scaler is None or not self.scaler.is_enabled():
            return False
        todo = [p for p in params if p.grad is not None and id(p) not in self._early]
        if todo:
            group = _GradGroup(todo)
            self.scaler.unscale_(cast(Any, group))
            self._early.update((id(p), group) for p in todo)
        return True

    def _owns_early(self, optimizer: torch.optim.Optimizer) -> bool:
        return any(id(p) in self._early for g in optimizer.param_groups for p in g["params"])

    def _unscale_rest(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Unscale what is left of ``optimizer``; its inf flags include the early unscaling's."""
        assert self.scaler is not None
        owned = [p for g in optimizer.param_groups for p in g["params"]]
        groups = {id(g): g for g in (self._early.get(id(p)) for p in owned) if g is not None}
        rest = [p for p in owned if id(p) not in self._early]
        if rest:
            group = _GradGroup(rest)
            self.scaler.unscale_(cast(Any, group))
            self._early.update((id(p), group) for p in rest)
            groups[id(group)] = group
        states: dict[int, dict[str, Any]] = self.scaler._per_optimizer_states
        found: dict[torch.device, torch.Tensor] = {}
        for key in groups:
            for device, flag in states[key]["found_inf_per_device"].items():
                found[device] = found[device] + flag if device in found else flag.clone()
        state["found_inf_per_device"] = found
        state["stage"] = OptState.UNSCALED

    def _forget_early(self) -> None:
        """A new backward begins: early unscaling no step consumed counts for nothing."""
        if self._early and self.scaler is not None:
            states: dict[int, dict[str, Any]] = self.scaler._per_optimizer_states
            for key in {id(g) for g in self._early.values()}:
                states.pop(key, None)
        self._early.clear()

    def must_skip(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale, look for inf/NaN; True when this step must be skipped (fp16 overflow)."""
        if not self.unscale(optimizer):
            return False
        state = self._optimizer_state(optimizer)
        assert state is not None
        self.pending_update = True
        found = sum(v.item() for v in state["found_inf_per_device"].values())
        return bool(found)

    def hand_over(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """Give a fused optimizer the scale and inf flag, as ``GradScaler.step`` does.

        Its kernel unscales the gradients it reads (unless they were unscaled for clipping) and
        leaves the parameters alone when the flag is set. Returns the flag (nonzero: the step is
        skipped), still on the device; None when ``optimizer`` takes no such hand-over.
        """
        if not _takes_scale(optimizer):
            return None
        state = self._optimizer_state(optimizer)
        if state is None:
            return None
        assert self.scaler is not None
        if state["stage"] is OptState.READY:
            if self._early and self._owns_early(optimizer):
                self._unscale_rest(optimizer, state)
            else:
                self.scaler._check_inf_per_device(optimizer)  # the check alone, no unscaling
        scale = self.scaler._get_scale_async()
        assert scale is not None
        found_inf = cast(torch.Tensor, sum(
            t.to(scale.device, non_blocking=True) for t in state["found_inf_per_device"].values()))
        # The same arithmetic as GradScaler.step, so the update is bit for bit the recipe's.
        held: Any = optimizer
        held.grad_scale = (getattr(optimizer, "grad_scale", None)
                           if state["stage"] is OptState.UNSCALED
                           else scale * getattr(optimizer, "grad_scale", 1))
        held.found_inf = found_inf
        self._handed.append(optimizer)
        self.pending_update = True
        return found_inf

    def take_back(self, optimizer: torch.optim.Optimizer) -> None:
        """The fused step returned: the optimizer keeps no scale or flag (GradScaler.step's end)."""
        if optimizer in self._handed:
            self._handed.remove(optimizer)
            state = self._optimizer_state(optimizer)
            if state is not None:
                state["stage"] = OptState.STEPPED
            _drop_handed(optimizer)

    def flush(self) -> None:
        """Apply the pending scale update (once per iteration, after every optimizer stepped)."""
        for optimizer in self._handed:  # a fused step that raised: it must not keep the flag
            _drop_handed(optimizer)
        self._handed.clear()
        if self.pending_update and self.scaler is not None:
            self.pending_update = False
            self.scaler.update()
            self._early.clear()

    def grads(self, session: Session, params: list[torch.Tensor]
              ) -> tuple[list[torch.Tensor], list[torch.Tensor], float] | None:
        """For clipping: (unscaled grads, still-scaled grads, scale); None when nothing is scaled."""
        if self.scaler is None or not self.scaler.is_enabled():
            return None
        wanted = {id(p) for p in params}
        unscaled: set[int] = set()
        for optimizer in list(session.optimizers):
            owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
            if owned & wanted and self.unscale(optimizer):
                unscaled |= owned
        # Gradients of an optimizer not met yet (clipping before its first step): unscaled
        # now, checked for inf/NaN before they are clipped; that optimizer's step takes it.
        unknown = [p for p in params if p.grad is not None and id(p) not in unscaled]
        if unknown and self.unscale_params(unknown):
            unscaled.update(id(p) for p in unknown)
        plain = [p.grad for p in params if p.grad is not None and id(p) in unscaled]
        scaled = [p.grad for p in params if p.grad is not None and id(p) not in unscaled]
        # reading the scale waits for the device: only when some gradients are still scaled
        return plain, scaled, float(self.scaler.get_scale()) if scaled else 1.0

    def current_scale(self) -> torch.Tensor | float:
        """The scale; a copy of the device's while a scaler runs (reading it is a host sync)."""
        if self.scaler is not None:
            scale = self.scaler._get_scale_async()
            if scale is not None:
                return scale.detach().clone().reshape(())
            return float(self.scaler.get_scale())
        if self._loaded is not None:
            return float(self._loaded["scale"])
        return self.init_scale

    def state_dict(self) -> dict[str, Any] | None:
        self.flush()
        if self.scaler is not None:
            return self.scaler.state_dict()
        return self._loaded

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.pending_update = False
        self._early.clear()
        if not state:
            return
        if self.scaler is not None:
            self.scaler.load_state_dict(state)
        else:
            self._loaded = dict(state)


def _takes_scale(optimizer: torch.optim.Optimizer) -> bool:
    """A fused optimizer taking ``grad_scale``/``found_inf`` attributes (GradScaler's contract)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and not _wants_scaler(
        type(optimizer).step)


@functools.cache
def _wants_scaler(step: Callable[..., Any]) -> bool:
    """An older custom optimizer whose step() takes a ``grad_scaler`` argument: the unfused way."""
    return "grad_scaler" in inspect.signature(step).parameters


def _drop_handed(optimizer: torch.optim.Optimizer) -> None:
    for name in ("grad_scale", "found_inf"):
        optimizer.__dict__.pop(name, None)
