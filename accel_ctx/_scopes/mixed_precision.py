"""``mixed_precision()`` and ``@autocast_forward``: the precision concern's scope.

``mixed_precision(policy)`` opens a :class:`~accel_ctx._precision.runtime.PrecisionRuntime`
(what it does at each point of a step is there). A launcher's ``--mixed-precision`` is a
default runtime that ``distributed()`` opens and any explicit ``mixed_precision()`` overrides.
``@autocast_forward`` runs a function under the policy open in this thread, else in this
process (helper threads: DataParallel replicas, thread pools).
"""

from __future__ import annotations

import os
import threading
from contextlib import ExitStack
from typing import Any, Literal, TypeVar, cast

import torch
import wrapt
from typing_extensions import override

from .._hooks.scope import Scope
from .._job import env as _env
from .._kernel import state as _state
from .._options import checked, positive, whole
from .._precision.fp8 import Fp8Filter, Fp8Options, check_options, require_torchao, runtime_for
from .._precision.runtime import (
    AUTO,
    PrecisionPolicy,
    PrecisionRuntime,
    policy_name,
    report_launcher_conflict,
)
from .._precision.true_half import HALF, open_runtime
from ..errors import ConfigurationError

F = TypeVar("F")


def _runtime_of(policy: PrecisionPolicy, device_type: str | None,
                fp8: Fp8Options | None = None) -> PrecisionRuntime:
    """The runtime of ``policy``: true half ('bf16-true', 'fp16-true'), fp8, or autocast's."""
    if policy.name in HALF and fp8 is None:
        return open_runtime(policy, device_type)
    return runtime_for(policy, device_type, fp8)  # refuses fp8's options on another policy


def check_env_policy() -> None:
    """Refuse a bad launcher ``--mixed-precision`` before the process group forms, so every
    rank raises the same ConfigurationError (not a peer's teardown mid-rendezvous)."""
    name = os.environ.get(_env.MIXED_PRECISION_VAR)
    if name and policy_name(name) == "fp8":
        require_torchao(f"the launcher's --mixed-precision {name}")


class _OpenPrecisions:
    """Precision runtimes open in any thread of this process, for ``@autocast_forward`` in
    helper threads (DataParallel replicas, thread pools), which have no scope of their own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, PrecisionRuntime] = {}

    def register(self, runtime: PrecisionRuntime) -> None:
        with self._lock:
            self._open[id(runtime)] = runtime

    def unregister(self, runtime: PrecisionRuntime) -> None:
        with self._lock:
            self._open.pop(id(runtime), None)

    def runtimes(self) -> list[PrecisionRuntime]:
        with self._lock:
            return list(self._open.values())

    def forget(self) -> None:
        """In a forked child: the parent's scopes are not open here."""
        self._lock = threading.Lock()
        self._open.clear()


_open = _OpenPrecisions()
_state.reset_after_fork(_open.forget)


def precision_from_env(device: torch.device, exits: ExitStack) -> PrecisionRuntime | None:
    """The launcher's ``--mixed-precision`` as a default for ``distributed()`` (lowest priority)."""
    name = os.environ.get(_env.MIXED_PRECISION_VAR)
    if not name or policy_name(name) == "no":
        return None
    runtime = _runtime_of(PrecisionPolicy(policy_name(name)), device.type)
    runtime.is_default = True  # an explicit mixed_precision() scope wins over it
    _open.register(runtime)
    exits.callback(_open.unregister, runtime)
    exits.callback(runtime.close)
    below = _state.current()
    explicit = below.find(PrecisionRuntime) if below is not None else None
    if explicit is None or explicit.is_default:
        exits.enter_context(runtime.autocast(device.type))
    return runtime


@checked
class mixed_precision(Scope):
    """Run forwards in reduced precision inside the scope: ``"bf16"``, ``"fp16"``, ``"fp8"``
    or ``"no"``.

    The scope's code runs as torch's AMP recipe runs it: under ``torch.autocast`` for the
    device (the job's, else CUDA where available, else the CPU), with ``loss.backward()`` and
    optimizer steps outside autocast. A training forward returns what autocast computed (a
    bf16 ``Linear`` output stays bf16, no fp32 copy is made), and the loss you compute from it
    in the scope follows autocast's per-op policy (``cross_entropy``, ``softmax`` and
    reductions in fp32), so ``loss.item()`` reads an fp32 value. A forward without gradients
    (evaluation) returns fp32 outputs, ready for ``.numpy()``; ``output_dtype=torch.float32``
    casts every forward's outputs, ``output_dtype=None`` none. With ``"fp16"``, ``loss.backward()`` scales the loss with a
    ``torch.amp.GradScaler``, ``opt.step()`` unscales, skips the step on inf/NaN gradients
    (``state().skipped_steps`` counts them) and the scale adapts; LR schedulers advance only
    with real steps. A fused optimizer (``fused=True``) gets the scale and the inf flag as
    ``GradScaler.step`` hands them over and skips on the device: nothing waits for the device
    until a scheduler steps or the count is read. ``None`` takes the launcher's
    ``--mixed-precision`` (default ``"no"``).
    ``"fp8"`` (needs torchao: ``pip install "accel-ctx[fp8]"``) runs as ``"bf16"`` and, at a
    model's first call, converts its ``nn.Linear`` layers whose in and out features are
    multiples of 16 to torchao's float8 training (``Float8Linear``, the same parameters and
    ``state_dict`` keys), before DDP or FSDP2 takes the model; ``fp8_filter(module, name)``
    returning False keeps a layer in bf16, and ``fp8_config`` takes a torchao
    ``Float8LinearConfig``.
    Works with or without ``distributed()``; nested, the innermost policy wins.

    ``"bf16-true"`` / ``"fp16-true"`` (Fabric's ``"bf16-true"`` / ``"16-true"``) train the model
    itself in half: at its first forward in the scope (before DDP or FSDP2 is built over it) its
    floating parameters and buffers are cast in place, with no autocast; floating inputs are
    cast to half and outputs stay half. Parameter and optimizer-state memory halve; there are
    no fp32 master weights and no loss scaling (``accel_ctx._precision.true_half``).

    Examples:
        >>> import torch
        >>> from accel_ctx import mixed_precision
        >>> model = torch.nn.Linear(4, 4)
        >>> with mixed_precision("bf16"):
        ...     out = model(torch.randn(2, 4))
        ...     loss = out.float().pow(2).mean()
        ...     with torch.no_grad():
        ...         evaluated = model(torch.randn(2, 4))
        >>> out.dtype, loss.dtype, evaluated.dtype
        (torch.bfloat16, torch.float32, torch.float32)
    """


    def __init__(
        self,
        policy: str | None = None,
        *,
        output_dtype: torch.dtype | Literal["auto"] | None = AUTO,
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
        fp8_filter: Fp8Filter | None = None,
        fp8_config: Any = None,
    ) -> None:
        super().__init__()
        if output_dtype not in (None, AUTO) and not isinstance(output_dtype, torch.dtype):
            raise ConfigurationError(
                f"mixed_precision(output_dtype={output_dtype!r}): give a torch.dtype, None "
                "(outputs as computed) or 'auto'."
            )
        self._requested = policy
        name = policy_name(policy) if policy is not None else None  # fail at the call site
        if name == "fp8":
            require_torchao()
        if policy is not None:
            report_launcher_conflict(policy)
        self._fp8 = check_options(fp8_filter, fp8_config, name)
        self._options = (
            output_dtype,
            positive("mixed_precision", "init_scale", init_scale,
                     "give the first fp16 loss scale, a positive finite number (default 65536)."),
            whole("mixed_precision", "growth_interval", growth_interval, 1,
                  "give the number of clean steps before the scale doubles, an int >= 1 "
                  "(default 2000)."),
        )

    @override
    def _open(self, exits: ExitStack) -> PrecisionRuntime:
        output_dtype, init_scale, growth_interval = self._options
        policy = PrecisionPolicy(
            policy_name(self._requested), output_dtype, init_scale, growth_interval
        )
        below = _state.current()
        device_type = below.job.device.type if below is not None and below.job else None
        runtime = _runtime_of(policy, device_type, self._fp8)
        _open.register(runtime)
        exits.callback(_open.unregister, runtime)
        exits.callback(runtime.close)
        # the scope's own code runs under autocast (the recipe's loss computation)
        exits.enter_context(runtime.autocast(runtime.scope_device_type()))
        return runtime


def _precision_for_here() -> PrecisionRuntime | None:
    stack = _state.current()
    if stack is not None:
        return stack.find(PrecisionRuntime)
    # A helper thread (DataParallel replica, thread pool) with no scope of its own: use the
    # policy open in this process; the most recently opened one if several are.
    open_now = _open.runtimes()
    return open_now[-1] if open_now else None


def _device_type_of(instance: Any, args: tuple[Any, ...], runtime: PrecisionRuntime) -> str:
    if isinstance(instance, torch.nn.Module):
        for p in instance.parameters():
            return p.device.type
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.type
    return runtime.device_type or "cpu"


@checked
def autocast_forward(fn: F) -> F:
    """Run ``fn`` (a forward, any function or method) under the active precision policy.

    Unlike ``torch.autocast``, which is thread-local, the policy reaches ``fn`` wherever it is
    called: in the scope's thread, and in helper threads that have no scope of their own
    (``nn.DataParallel`` replicas, a thread pool started inside the scope). Outside any scope
    it is a plain call.

    Examples:
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
    if not callable(fn):
        raise TypeError(
            f"@autocast_forward decorates functions and methods, got a {type(fn).__name__}; "
            "write it on the line above a def (e.g. a module's forward).")

    def run(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        runtime = _precision_for_here()
        if runtime is None or runtime.dtype is None:
            return wrapped(*args, **kwargs)
        device_type = _device_type_of(instance, args, runtime)
        with runtime.autocast(device_type):
            out = wrapped(*args, **kwargs)
        kept = (torch.is_grad_enabled() and torch.is_autocast_enabled(device_type)
                and torch.get_autocast_dtype(device_type) == runtime.dtype)
        return runtime.cast_output(out, kept)

    return cast(F, wrapt.FunctionWrapper(cast(Any, fn), run))
