"""The precision concern's runtime: the policy and what it does at each point of a step.

The rule is torch's AMP recipe, ``with torch.autocast(...): out = model(x); loss = f(out)``
then ``loss.backward()`` and ``opt.step()`` outside it: the scope's code runs under
``torch.autocast`` for the scope's device, ``loss.backward()`` and optimizer steps run with it
switched off, and a training forward's outputs are what autocast made (a bf16 logits tensor
stays bf16: no fp32 copy the recipe never makes; the loss computed from it under the scope's
autocast follows autocast's per-op policy, e.g. ``cross_entropy`` in fp32). Outputs are cast
to fp32 where code after the forward would not run under the same autocast (a forward with no
gradients, for reading results; a model on another device type; a helper thread) and when
``output_dtype`` asks. fp16 scales the loss (``loss_scale``).
"""

from __future__ import annotations

import operator
import os
import warnings
import weakref
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
from torch import nn
from typing_extensions import override

from .._job import env as _env
from .._kernel import state as _state
from .._kernel.concern import Concern, ForwardCall, Grads
from .._kernel.order import ORDER
from .._kernel.session import Session
from .._kernel.tree import cast_floating
from .._warn import warn_user
from ..errors import ConfigurationError
from .loss_scale import LossScaler
from .names import canonical

F = TypeVar("F")
AUTO: Literal["auto"] = "auto"


def policy_name(policy: str | None) -> str:
    if policy is None:
        policy = os.environ.get(_env.MIXED_PRECISION_VAR, "no")
    if not isinstance(policy, str):
        raise ConfigurationError(
            f"mixed_precision({policy!r}): give one of 'bf16', 'fp16', 'fp8' or 'no' (or "
            "'bf16-true', 'fp16-true') as a string."
        )
    name = canonical(policy)
    if name is None:
        raise ConfigurationError(
            f"unknown mixed-precision policy {policy!r}; valid policies are 'bf16', 'fp16', "
            "'fp8' and 'no', and 'bf16-true' or 'fp16-true' for a model trained in half "
            "precision itself (None takes the launcher's --mixed-precision, default 'no')."
        )
    return name


_CONFLICTS_REPORTED: set[tuple[str, str]] = set()


def report_launcher_conflict(policy: str) -> None:
    """An explicit policy beats the launcher's ``--mixed-precision``; rank 0 says so once."""
    launcher = os.environ.get(_env.MIXED_PRECISION_VAR, "").strip()
    theirs = canonical(launcher)
    mine = policy_name(policy)
    if theirs is None or mine == theirs or (mine, theirs) in _CONFLICTS_REPORTED:
        return  # no launcher setting, a bad one (distributed() reports it), or agreement
    _CONFLICTS_REPORTED.add((mine, theirs))
    stack = _state.current()
    rank = stack.job.rank if stack is not None and stack.job is not None else (
        int(os.environ["RANK"]) if os.environ.get("RANK", "").isdigit() else 0)
    if rank == 0:
        warn_user(
            f"mixed_precision({policy!r}) in the script overrides the launcher's "
            f"--mixed-precision {launcher} ({_env.MIXED_PRECISION_VAR}): this scope runs in "
            f"{'fp32' if mine == 'no' else mine}. An explicit policy wins; to follow the "
            "launcher, call mixed_precision() without a policy, or drop --mixed-precision.")


_VERSION = operator.attrgetter("_version")  # a tensor's in-place version counter


@dataclass(frozen=True)
class PrecisionPolicy:
    """What a ``mixed_precision()`` scope asks for."""

    name: str
    """'bf16', 'fp16', 'fp8' or 'no'; 'bf16-true' or 'fp16-true' (``_precision.true_half``)."""
    output_dtype: torch.dtype | Literal["auto"] | None = AUTO
    """Floating outputs of a top-level forward are cast to this (None: kept as computed;
    "auto": kept where the caller's code runs under the same autocast, else fp32)."""
    init_scale: float = 2.0**16
    """fp16: the first loss scale."""
    growth_interval: int = 2000
    """fp16: clean steps before the scale doubles."""

    @property
    def dtype(self) -> torch.dtype | None:
        # fp8: the layers that are not converted to float8 compute in bf16
        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}.get(
            self.name)


def _check_supported(device_type: str, policy: PrecisionPolicy) -> None:
    dtype = policy.dtype
    if dtype is None:
        return
    problem = None
    if not torch.amp.is_autocast_available(device_type):
        problem = f"autocast is not available on {device_type!r}"
    elif device_type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        problem = "this GPU cannot compute in bf16"
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.autocast(device_type, dtype=dtype)
        if any("not supported" in str(w.message) for w in caught):
            problem = f"{device_type} autocast does not support {dtype}"
    if problem is not None:
        other = "'bf16'" if policy.name == "fp16" else "'fp16'"
        raise ConfigurationError(
            f"mixed_precision({policy.name!r}) cannot run here: {problem}. Use {other} or 'no', "
            "or run on a device that supports it."
        )


# PrecisionRuntime's hooks that only scale fp16 losses, and those that only switch autocast
_SCALING_HOOKS = frozenset({"before_backward", "skips_step", "grads_for_clipping"})
_AUTOCAST_HOOKS = frozenset({"backward_context", "before_step", "after_step"})


class _AutocastPaused:
    """Autocast switched off for a ``loss.backward()`` and back on after it: what
    ``torch.autocast(device_type, enabled=False)`` does there (same dtype and cache setting,
    the cache already cleared), without building one per step (its Python costs a few µs)."""

    __slots__ = ("device_type",)

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type

    def __enter__(self) -> None:
        torch.set_autocast_enabled(self.device_type, False)

    def __exit__(self, *exc: object) -> None:
        torch.set_autocast_enabled(self.device_type, True)  # on before (backward_context)


class PrecisionRuntime(Concern):
    """The live side of one ``mixed_precision()`` entry: autocast, fp16 loss scaling, counters."""

    slot, order = "precision", ORDER["precision"]

    def __init__(self, policy: PrecisionPolicy, device_type: str | None) -> None:
        self.policy = policy
        self.dtype = policy.dtype
        self.device_type = device_type
        self.scaling = (LossScaler(policy.init_scale, policy.growth_interval)
                        if self.dtype == torch.float16 else None)
        self._step_paused: str | None = None  # the autocast switched off for a step()
        self._backward_paused: dict[str, _AutocastPaused] = {}
        # per top-level module: its parameters and the sum of their versions at its last forward
        self._weights: weakref.WeakKeyDictionary[nn.Module, list[Any]] = (
            weakref.WeakKeyDictionary())
        self._checked: set[str] = set()
        if device_type is not None:
            self._check(device_type)

    @override
    def overrides(self, hook: str) -> bool:
        """Leave out the hooks of ours that do nothing under this policy: a hook called
        every step costs its Python even when it only returns."""
        if getattr(type(self), hook) is getattr(PrecisionRuntime, hook, None):
            if hook in _SCALING_HOOKS and self.scaling is None:
                return False
            if hook in _AUTOCAST_HOOKS and self.dtype is None and self.scaling is None:
                return False
        return super().overrides(hook)

    def _check(self, device_type: str) -> None:
        if device_type not in self._checked:
            _check_supported(device_type, self.policy)
            self._checked.add(device_type)

    # ---- forward -------------------------------------------------------------------------------
    def autocast(self, device_type: str) -> AbstractContextManager[Any]:
        if self.dtype is None:  # "no" turns off an enclosing autocast too
            return torch.autocast(device_type, enabled=False)
        self._check(device_type)
        return torch.autocast(device_type, dtype=self.dtype)

    def scope_device_type(self) -> str:
        """The device type the scope's own code runs under autocast for."""
        if self.device_type is not None:
            return self.device_type
        return "cuda" if torch.cuda.is_available() else "cpu"

    @override
    def forward_context(self, call: ForwardCall) -> AbstractContextManager[Any] | None:
        device_type = call.device_type or "cpu"
        if self.dtype is not None:
            self._drop_stale_casts(call.module)
            if torch.is_autocast_enabled(device_type) \
                    and torch.get_autocast_dtype(device_type) == self.dtype:
                # the policy's autocast is on (the scope's own, for its code): entering it again
                # changes nothing but a nesting count, and costs a torch.autocast every step
                return None
        elif not torch.is_autocast_enabled(device_type):
            return None  # "no", and autocast is off already
        return self.autocast(device_type)

    def _drop_stale_casts(self, module: nn.Module) -> None:
        """Autocast caches each weight's low-precision copy until its outermost region ends,
        which the scope's region never does within the scope. The recipe's region ends before
        each backward (``backward_context`` clears the cache there, as its exit would); a
        weight changed in place in between (an optimizer step, ``load_state_dict``, an EMA
        swap for evaluation) shows in its version counter, and its stale copy is dropped
        before the forward that would use it. Forwards of an unchanged model within one step
        share the copies, as within one ``with torch.autocast()``."""
        seen = self._weights.get(module)
        if seen is None:  # listed once per scope: walking a deep model's modules is not free
            params = list(module.parameters())
            self._weights[module] = [params, sum(map(_VERSION, params))]
            torch.clear_autocast_cache()
            return
        now = sum(map(_VERSION, seen[0]))  # no Python frame per parameter: every forward
        if now != seen[1]:
            seen[1] = now
            torch.clear_autocast_cache()

    def cast_output(self, out: Any, kept: bool = False) -> Any:
        """``out`` as the caller gets it; ``kept``: the caller's code runs under this autocast."""
        wanted = self.policy.output_dtype
        if self.dtype is None or wanted is None or (wanted == AUTO and kept):
            return out
        return cast_floating(out, torch.float32 if wanted == AUTO else wanted)

    @override
    def after_forward(self, call: ForwardCall, out: Any) -> Any:
        device_type = call.device_type or "cpu"
        kept = (call.grad and torch.is_autocast_enabled(device_type)
                and torch.get_autocast_dtype(device_type) == self.dtype)
        return self.cast_output(out, kept)

    @override
    def backward_context(self) -> AbstractContextManager[Any] | None:
        device_type = self.scope_device_type()
        if self.dtype is None or not torch.is_autocast_enabled(device_type):
            return None
        torch.clear_autocast_cache()  # the recipe's autocast ended before its backward
        paused = self._backward_paused.get(device_type)
        if paused is None:
            paused = self._backward_paused[device_type] = _AutocastPaused(device_type)
        return paused  # backward runs outside autocast

    @override
    def before_step(self, session: Session) -> None:
        device_type = self.scope_device_type()
        if self.dtype is not None and torch.is_autocast_enabled(device_type):
            torch.set_autocast_enabled(device_type, False)  # steps run outside autocast
            self._step_paused = device_type

    @override
    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaling is not None:
            self.scaling.take_back(optimizer)
        if self.dtype is not None:
            torch.clear_autocast_cache()  # the weights just changed
        if self._step_paused is not None:
            torch.set_autocast_enabled(self._step_paused, True)
            self._step_paused = None

    # ---- fp16 loss scaling -----------------------------------------------------------------------
    @override
    def before_backward(self, loss: torch.Tensor, session: Session) -> torch.Tensor:
        return self.scaling.scale(loss) if self.scaling is not None else loss

    @override
    def skips_step(self, optimizer: torch.optim.Optimizer) -> bool | torch.Tensor:
        if self.scaling is None:
            return False
        flag = self.scaling.hand_over(optimizer)  # a fused step skips itself: no host sync
        return flag if flag is not None else self.scaling.must_skip(optimizer)

    @override
    def grads_for_clipping(self, session: Session, params: list[torch.Tensor]) -> Grads | None:
        return self.scaling.grads(session, params) if self.scaling is not None else None

    def flush(self) -> None:
        """Apply the pending scale update (the end of an iteration: a checkpoint, the exit)."""
        if self.scaling is not None:
            self.scaling.flush()

    @override
    def before_checkpoint(self) -> None:
        self.flush()  # the pending scale update would otherwise wait for the next backward

    @override
    def snapshot(self) -> dict[str, Any]:
        return {"mixed_precision": self.policy.name}

    @override
    def loss_scaling(self) -> LossScaler | None:
        return self.scaling

    @override
    def compute_dtype(self) -> torch.dtype | None:
        return self.dtype  # a sharded model's MixedPrecisionPolicy: params gathered in it

    @override
    def state_dict(self) -> dict[str, Any]:
        scaler = self.scaling.state_dict() if self.scaling is not None else None
        return {"policy": self.policy.name, "scaler": scaler}

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaling is not None:
            self.scaling.load_state_dict(state["scaler"])

    def close(self) -> None:
        self.flush()
