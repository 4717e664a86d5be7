"""``mixed_precision()`` and ``@autocast_forward``: the precision concern.

The forward of each top-level module call runs under ``torch.autocast``; the backward never
does. fp16 scales the loss (``_loss_scale``). A launcher's ``--mixed-precision`` is a default
runtime that ``distributed()`` opens and any explicit ``mixed_precision()`` overrides.
"""

from __future__ import annotations

import os
import warnings
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
import wrapt

from . import _env, _state
from ._concern import Concern, ForwardCall, Grads
from ._loss_scale import LossScaler
from ._precision_names import canonical
from ._scope import Scope
from ._session import Session
from ._tree import cast_floating
from ._warn import warn_user
from .errors import ConfigurationError

F = TypeVar("F")


def _policy_name(policy: str | None) -> str:
    if policy is None:
        policy = os.environ.get(_env.MIXED_PRECISION_VAR, "no")
    if not isinstance(policy, str):
        raise ConfigurationError(
            f"mixed_precision({policy!r}): give one of 'bf16', 'fp16' or 'no' as a string."
        )
    name = canonical(policy)
    if name is None:
        raise ConfigurationError(
            f"unknown mixed-precision policy {policy!r}; valid policies are 'bf16', 'fp16' and "
            "'no' (None takes the launcher's --mixed-precision, default 'no')."
        )
    return name


_CONFLICTS_REPORTED: set[tuple[str, str]] = set()


def _report_launcher_conflict(policy: str) -> None:
    """An explicit policy beats the launcher's ``--mixed-precision``; rank 0 says so once."""
    launcher = os.environ.get(_env.MIXED_PRECISION_VAR, "").strip()
    theirs = canonical(launcher)
    mine = _policy_name(policy)
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
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.name)


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


class PrecisionRuntime(Concern):
    """The live side of one ``mixed_precision()`` entry: autocast, fp16 loss scaling, counters."""

    slot, order = "precision", 30

    def __init__(self, policy: PrecisionPolicy, device_type: str | None) -> None:
        self.policy = policy
        self.dtype = policy.dtype
        self.device_type = device_type
        self.scaling = (LossScaler(policy.init_scale, policy.growth_interval)
                        if self.dtype == torch.float16 else None)
        self.skipped_steps = 0
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

    def forward_context(self, call: ForwardCall) -> AbstractContextManager[Any]:
        return self.autocast(call.device_type or "cpu")

    def cast_output(self, out: Any) -> Any:
        if self.dtype is None or self.policy.output_dtype is None:
            return out
        return cast_floating(out, self.policy.output_dtype)

    def after_forward(self, call: ForwardCall, out: Any) -> Any:
        return self.cast_output(out)

    # ---- fp16 loss scaling -----------------------------------------------------------------------
    def before_backward(self, loss: torch.Tensor, session: Session) -> torch.Tensor:
        return self.scaling.scale(loss) if self.scaling is not None else loss

    def skips_step(self, optimizer: torch.optim.Optimizer) -> bool:
        if self.scaling is None or not self.scaling.must_skip(optimizer):
            return False
        self.skipped_steps += 1
        return True

    def grads_for_clipping(self, session: Session, params: list[torch.Tensor]) -> Grads | None:
        return self.scaling.grads(session, params) if self.scaling is not None else None

    def flush(self) -> None:
        """Apply the pending scale update (the end of an iteration: a checkpoint, the exit)."""
        if self.scaling is not None:
            self.scaling.flush()

    def loss_scale(self) -> float | None:
        return self.scaling.current_scale() if self.scaling is not None else None

    def compute_dtype(self) -> torch.dtype | None:
        return self.dtype  # a sharded model's MixedPrecisionPolicy: params gathered in it

    def state_dict(self) -> dict[str, Any]:
        scaler = self.scaling.state_dict() if self.scaling is not None else None
        return {"policy": self.policy.name, "scaler": scaler, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped_steps = int(state["skipped_steps"])
        if self.scaling is not None:
            self.scaling.load_state_dict(state["scaler"])

    def close(self) -> None:
        self.flush()


def precision_from_env(device: torch.device, exits: ExitStack) -> PrecisionRuntime | None:
    """The launcher's ``--mixed-precision`` as a default for ``distributed()`` (lowest priority)."""
    name = os.environ.get(_env.MIXED_PRECISION_VAR)
    if not name or _policy_name(name) == "no":
        return None
    runtime = PrecisionRuntime(PrecisionPolicy(_policy_name(name)), device.type)
    runtime.is_default = True  # an explicit mixed_precision() scope wins over it
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
        device_type = below.job.device.type if below is not None and below.job else None
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
        return stack.find(PrecisionRuntime)
    # A helper thread (DataParallel replica, thread pool) with no scope of its own: use the
    # policy open in this process; the most recently opened one if several are.
    open_now = [r for r in _state.open_precisions() if isinstance(r, PrecisionRuntime)]
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
