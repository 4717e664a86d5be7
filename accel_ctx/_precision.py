"""``mixed_precision()``, ``@autocast_forward`` and fp16 loss scaling.

The forward of each top-level module call runs under ``torch.autocast``; the backward never
does. For fp16, ``torch.amp.GradScaler`` does the scaling: ``loss.backward()`` scales,
``opt.step()`` unscales, checks for inf/NaN and skips the step when needed. The scale is updated
once per iteration, just before the next scaled backward (or when the scope ends), so several
optimizers stepping on one backward all unscale with the scale their gradients were made with.
"""

from __future__ import annotations

import os
import warnings
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
import wrapt
from torch.amp.grad_scaler import OptState

from . import _env, _state
from ._scope import Scope
from ._tree import cast_floating
from ._warn import warn_user
from .errors import ConfigurationError

F = TypeVar("F")


class _GradGroup:
    """Parameters posing as an optimizer for ``GradScaler.unscale_`` (it reads param_groups).

    Clipping can come before accel_ctx has met the optimizer that owns the gradients (a loop
    whose first ``opt.step()`` follows the first clip): they are unscaled through the scaler
    under this stand-in, so clipping sees unscaled gradients and the inf/NaN check happens
    before clipping could hide an overflow.
    """

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.param_groups = [{"params": params}]

_DTYPES: dict[str, torch.dtype | None] = {"bf16": torch.bfloat16, "fp16": torch.float16, "no": None}
_ALIASES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "fp32": "no",
    "float32": "no",
    "none": "no",
    "off": "no",
}


def _policy_name(policy: str | None) -> str:
    if policy is None:
        policy = os.environ.get(_env.MIXED_PRECISION_VAR, "no")
    if not isinstance(policy, str):
        raise ConfigurationError(
            f"mixed_precision({policy!r}): give one of 'bf16', 'fp16' or 'no' as a string."
        )
    name = _ALIASES.get(policy.lower(), policy.lower())
    if name not in _DTYPES:
        raise ConfigurationError(
            f"unknown mixed-precision policy {policy!r}; valid policies are 'bf16', 'fp16' and "
            "'no' (None takes the launcher's --mixed-precision, default 'no')."
        )
    return name


_CONFLICTS_REPORTED: set[tuple[str, str]] = set()


def _report_launcher_conflict(policy: str) -> None:
    """An explicit policy beats the launcher's ``--mixed-precision``; rank 0 says so once."""
    launcher = os.environ.get(_env.MIXED_PRECISION_VAR, "").strip()
    theirs = _ALIASES.get(launcher.lower(), launcher.lower())
    mine = _policy_name(policy)
    if theirs not in _DTYPES or mine == theirs or (mine, theirs) in _CONFLICTS_REPORTED:
        return  # no launcher setting, a bad one (distributed() reports it), or agreement
    _CONFLICTS_REPORTED.add((mine, theirs))
    stack = _state.current()
    rank = stack.dist.rank if stack is not None and stack.dist is not None else (
        int(os.environ["RANK"]) if os.environ.get("RANK", "").isdigit() else 0)
    if rank == 0:
        warn_user(
            f"mixed_precision({policy!r}) in the script overrides the launcher's "
            f"--mixed-precision {launcher} ({_env.MIXED_PRECISION_VAR}): this scope runs in "
            f"{'fp32' if mine == 'no' else mine}. An explicit policy wins; to follow the "
            "launcher, call mixed_precision() without a policy, or drop --mixed-precision.")


@dataclass(frozen=True)
class PrecisionPolicy:
    """What a ``mixed_precision()`` scope asks for."""

    name: str
    """'bf16', 'fp16' or 'no'."""
    output_dtype: torch.dtype | None = torch.float32
    """Floating outputs of an adopted module's forward are cast to this (None: keep them)."""
    init_scale: float = 2.0**16
    """fp16: the first loss scale."""
    growth_interval: int = 2000
    """fp16: clean steps before the scale doubles."""

    @property
    def dtype(self) -> torch.dtype | None:
        return _DTYPES[self.name]


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


class PrecisionRuntime:
    """The live side of one ``mixed_precision()`` entry: policy, GradScaler, counters."""

    def __init__(self, policy: PrecisionPolicy, device_type: str | None) -> None:
        self.policy = policy
        self.dtype = policy.dtype
        self.device_type = device_type
        self.scaler: torch.amp.GradScaler | None = None
        self.pending_update = False
        self.skipped_steps = 0
        # Parameters unscaled before their optimizer was known (id -> the stand-in used).
        self._early: dict[int, _GradGroup] = {}
        self._checked: set[str] = set()
        if device_type is not None:
            self._check(device_type)

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

    def cast_output(self, out: Any) -> Any:
        if self.dtype is None or self.policy.output_dtype is None:
            return out
        return cast_floating(out, self.policy.output_dtype)

    # ---- fp16 loss scaling -----------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self.dtype != torch.float16:
            return loss
        self.flush()
        self._forget_early()
        if self.scaler is None:
            self.scaler = torch.amp.GradScaler(
                loss.device.type,
                init_scale=self.policy.init_scale,
                growth_interval=self.policy.growth_interval,
            )
        return self.scaler.scale(loss)

    def _optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
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

    def flush(self) -> None:
        """Apply the pending scale update (once per iteration, after every optimizer stepped)."""
        if self.pending_update and self.scaler is not None:
            self.pending_update = False
            self.scaler.update()
            self._early.clear()

    def loss_scale(self) -> float | None:
        if self.scaler is None:
            return self.policy.init_scale if self.dtype == torch.float16 else None
        return float(self.scaler.get_scale())

    def close(self) -> None:
        self.flush()


def precision_from_env(device: torch.device, exits: ExitStack) -> PrecisionRuntime | None:
    """The launcher's ``--mixed-precision`` as a default for ``distributed()`` (lowest priority)."""
    name = os.environ.get(_env.MIXED_PRECISION_VAR)
    if not name or _policy_name(name) == "no":
        return None
    runtime = PrecisionRuntime(PrecisionPolicy(_policy_name(name)), device.type)
    _state.register_precision(runtime)
    exits.callback(_state.unregister_precision, runtime)
    exits.callback(runtime.close)
    return runtime


class mixed_precision(Scope):
    """Run forwards in reduced precision inside the scope: ``"bf16"``, ``"fp16"`` or ``"no"``.

    Each top-level module call runs its forward under ``torch.autocast`` for the device and
    returns fp32 outputs (``output_dtype=None`` keeps them as computed); backward never runs
    under autocast. With ``"fp16"``, ``loss.backward()`` scales the loss with a
    ``torch.amp.GradScaler``, ``opt.step()`` unscales, skips the step on inf/NaN gradients
    (``state().skipped_steps`` counts them) and the scale adapts; LR schedulers advance only
    with real steps. ``None`` takes the launcher's ``--mixed-precision`` (default ``"no"``).
    Works with or without ``distributed()``; nested, the innermost policy wins.

    Example:
        >>> import torch
        >>> from accel_ctx import mixed_precision
        >>> model = torch.nn.Linear(4, 4)
        >>> with mixed_precision("bf16"):
        ...     out = model(torch.randn(2, 4))
        >>> out.dtype
        torch.float32
    """

    concern = "precision"

    def __init__(
        self,
        policy: str | None = None,
        *,
        output_dtype: torch.dtype | None = torch.float32,
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
    ) -> None:
        super().__init__()
        if output_dtype is not None and not isinstance(output_dtype, torch.dtype):
            raise ConfigurationError(
                f"mixed_precision(output_dtype={output_dtype!r}): give a torch.dtype or None."
            )
        self._requested = policy
        if policy is not None:
            _policy_name(policy)  # fail at the call site, not at entry
            _report_launcher_conflict(policy)
        self._options = (output_dtype, float(init_scale), int(growth_interval))

    def _open(self, exits: ExitStack) -> PrecisionRuntime:
        output_dtype, init_scale, growth_interval = self._options
        policy = PrecisionPolicy(
            _policy_name(self._requested), output_dtype, init_scale, growth_interval
        )
        below = _state.current()
        device_type = below.dist.device.type if below is not None and below.dist else None
        runtime = PrecisionRuntime(policy, device_type)
        _state.register_precision(runtime)
        exits.callback(_state.unregister_precision, runtime)
        exits.callback(runtime.close)
        if below is not None and below.in_forward:  # opened inside a forward: applies at once
            default = "cuda" if torch.cuda.is_available() else "cpu"
            exits.enter_context(runtime.autocast(device_type or default))
        return runtime


def _precision_for_here() -> PrecisionRuntime | None:
    stack = _state.current()
    if stack is not None:
        return stack.effective_precision()
    # A helper thread (DataParallel replica, thread pool) with no scope of its own: use the
    # policy open in this process; the most recently opened one if several are.
    open_now = _state.open_precisions()
    return open_now[-1] if open_now else None


def _device_type_of(instance: Any, args: tuple[Any, ...], runtime: PrecisionRuntime) -> str:
    if isinstance(instance, torch.nn.Module):
        for p in instance.parameters():
            return p.device.type
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.type
    return runtime.device_type or "cpu"


def autocast_forward(fn: F) -> F:
    """Run ``fn`` (a forward, any function or method) under the active precision policy.

    Unlike ``torch.autocast``, which is thread-local, the policy reaches ``fn`` wherever it is
    called: in the scope's thread, and in helper threads that have no scope of their own
    (``nn.DataParallel`` replicas, a thread pool started inside the scope). Outside any scope
    it is a plain call.

    Example:
        >>> import torch
        >>> from accel_ctx import autocast_forward, mixed_precision
        >>> class Net(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.fc = torch.nn.Linear(4, 4)
        ...     @autocast_forward
        ...     def forward(self, x):
        ...         return self.fc(x)
        >>> Net().forward(torch.randn(2, 4)).dtype
        torch.float32
    """
    if isinstance(fn, type):
        raise TypeError(
            f"@autocast_forward decorates functions and methods, not the class {fn.__qualname__};"
            " decorate its forward method instead."
        )

    def run(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        runtime = _precision_for_here()
        if runtime is None or runtime.dtype is None:
            return wrapped(*args, **kwargs)
        with runtime.autocast(_device_type_of(instance, args, runtime)):
            out = wrapped(*args, **kwargs)
        return runtime.cast_output(out)

    return cast(F, wrapt.FunctionWrapper(cast(Any, fn), run))
