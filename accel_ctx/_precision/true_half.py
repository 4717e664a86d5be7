"""True half precision: ``mixed_precision("bf16-true")`` and ``mixed_precision("fp16-true")``.

Lightning Fabric's ``"bf16-true"`` / ``"16-true"``: the model itself lives in the half dtype.
When the scope first meets a model (its adoption by ``distributed()``, before it moves and
before DDP, FSDP2 or TP is built over it; else its first top-level call) every floating
parameter and buffer is cast in place (``param.data``: the same ``Parameter`` objects, so an
optimizer made before the first forward keeps them, and every optimizer's state is made in
half). There is no autocast: floating inputs are cast to the half dtype at the forward and the
outputs stay half. There are no fp32 master weights, so an update smaller than half a unit in
the last place of a weight is lost to rounding (bf16 keeps 8 bits of mantissa), and fp16 has no
loss scaling: ``GradScaler`` cannot unscale fp16 gradients, and small gradients underflow to
zero (prefer ``"bf16-true"``). The cast is the model's for good: it stays half after the scope.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from .._engines import records as _records
from .._kernel import state as _state
from .._kernel.concern import ForwardCall
from .._kernel.session import Session
from .._kernel.tree import cast_floating, map_tensors, to_device
from .._warn import warn_user
from ..errors import ConfigurationError
from .runtime import AUTO, PrecisionPolicy, PrecisionRuntime

HALF = {"bf16-true": torch.bfloat16, "fp16-true": torch.float16}
"""The true-half policies and the dtype each keeps the model in."""


def open_runtime(policy: PrecisionPolicy, device_type: str | None) -> PrecisionRuntime:
    """The runtime of ``policy``: true half for 'bf16-true' / 'fp16-true', else autocast's."""
    half = HALF.get(policy.name)
    if half is None:
        return PrecisionRuntime(policy, device_type)
    return TrueHalfRuntime(policy, device_type, half)


class TrueHalfRuntime(PrecisionRuntime):
    """The live side of ``mixed_precision("bf16-true")``: the model in half, no autocast.

    Its ``dtype`` (the autocast dtype) is None, so the autocast and loss-scaling hooks it
    inherits do nothing but keep autocast off, as under ``"no"``; ``half`` is the model's dtype.
    """

    def __init__(self, policy: PrecisionPolicy, device_type: str | None,
                 half: torch.dtype) -> None:
        self.half = half
        # the modules this entry made (or found) half, by identity (a module class may define
        # __eq__), each with a weak reference: a dead module's id may be reused
        self._taken: dict[int, weakref.ref[nn.Module]] = {}
        super().__init__(policy, device_type)

    @override
    def _check(self, device_type: str) -> None:
        if device_type in self._checked:
            return
        if device_type == "cuda" and self.half == torch.bfloat16 and not (
                torch.cuda.is_available() and torch.cuda.is_bf16_supported()):
            raise ConfigurationError(
                f"mixed_precision({self.policy.name!r}) cannot run here: this GPU cannot compute "
                "in bf16. Use 'fp16-true' (no loss scaling: small gradients underflow) or 'fp16' "
                "(autocast with loss scaling), or run on a GPU that supports bf16.")
        self._checked.add(device_type)

    # ---- the model, cast once ------------------------------------------------------------------
    @override
    def adopting(self, module: nn.Module) -> None:
        self.take(module)  # before the engine is built: DDP and FSDP2 see half parameters

    def take(self, module: nn.Module, engine_built: bool = False) -> None:
        """Cast ``module``'s floating parameters and buffers to the half dtype in place (once
        per scope entry; nothing to do when they are half already)."""
        taken = self._taken.get(id(module))
        if taken is not None and taken() is module:
            return
        tensors = [t for t in (*module.parameters(), *module.buffers())
                   if t.is_floating_point() and t.dtype != self.half]
        if tensors:
            _refuse_engine(module, self.policy.name, engine_built)
            self._check(tensors[0].device.type)
            cast_in_place(module, self.half)
            stack = _state.current()
            for optimizer in list(stack.session.optimizers.keys()) if stack is not None else ():
                cast_state(optimizer, self.half)  # made before the cast (a loaded checkpoint)
        self._taken[id(module)] = weakref.ref(module)

    @override
    def before_forward(self, call: ForwardCall, session: Session) -> None:
        # under distributed() adoption cast it already; an engine over fp32 weights is refused
        self.take(call.module, engine_built=call.engine is not None)
        job = _state.current_job()
        args, kwargs = call.args, call.kwargs
        if job is not None and job.device.type != "cpu":
            # on the device first: the cast runs there, not on the host (DDP moved them itself)
            args, kwargs = to_device(args, job.device), to_device(kwargs, job.device)
        call.args, call.kwargs = cast_inputs(args, self.half), cast_inputs(kwargs, self.half)

    @override
    def first_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        cast_state(optimizer, self.half)  # an optimizer that stepped before the model was cast
        if self.half == torch.float16:
            _warn_small_eps(optimizer)

    # ---- outputs: as computed (half), unless output_dtype names a dtype ------------------------
    @override
    def cast_output(self, out: Any, kept: bool = False) -> Any:
        wanted = self.policy.output_dtype
        if wanted is None or wanted == AUTO:
            return out
        return cast_floating(out, wanted)


def cast_in_place(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast the floating parameters (and their gradients) and buffers of ``module`` to
    ``dtype``, keeping every tensor object: optimizers, ties and references stay valid."""
    with torch.no_grad():
        for param in module.parameters():
            if param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)
                if param.grad is not None:
                    param.grad = param.grad.to(dtype)
        for buffer in module.buffers():
            if buffer.is_floating_point() and buffer.dtype != dtype:
                buffer.data = buffer.data.to(dtype)


def cast_state(optimizer: torch.optim.Optimizer, dtype: torch.dtype) -> None:
    """Cast ``optimizer``'s per-element state (exp_avg, momentum_buffer: shaped like the
    parameter) of parameters in ``dtype`` to it; step counters and scalars stay as they are."""
    state: dict[Any, Any] = optimizer.state
    for param, entries in state.items():
        if not isinstance(param, torch.Tensor) or param.dtype != dtype:
            continue
        for key, value in list(entries.items()):
            if (isinstance(value, torch.Tensor) and value.is_floating_point()
                    and value.dtype != dtype and value.dim() > 0 and value.shape == param.shape):
                entries[key] = value.to(dtype)


def cast_inputs(obj: Any, dtype: torch.dtype) -> Any:
    """``obj`` with every floating tensor in ``dtype`` (integer tensors, e.g. tokens, as they are)."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return map_tensors(obj, cast)


SAFE_FP16_EPS = 1e-4
"""fp16's smallest number is 6e-8: the square of a gradient below about 2e-4 is 0 in fp16 state,
and Adam's step is then exp_avg / eps; an eps of about 1e-4 keeps that step bounded."""


def _warn_small_eps(optimizer: torch.optim.Optimizer) -> None:
    """Adam-like optimizers (Adam, AdamW, RMSprop, Adagrad, ...) with fp16 state and their
    default eps: an fp16-true loop that diverges from its first steps, said once, on rank 0."""
    small = sorted({g["eps"] for g in optimizer.param_groups
                    if isinstance(g.get("eps"), float) and g["eps"] < SAFE_FP16_EPS
                    and any(p.dtype == torch.float16 for p in g["params"])})
    if not small or _state.coordinates().rank != 0:
        return
    name = type(optimizer).__name__
    warn_user(
        f"mixed_precision('fp16-true'): this {name}'s eps={small[0]:g} is too small for fp16 "
        "state. fp16's smallest number is 6e-08 (1e-08 is 0 in fp16): where a gradient is below "
        "about 2e-4 its square is 0, and the step divides by eps alone: huge steps or inf/NaN. "
        f"Give {name}(..., eps={SAFE_FP16_EPS:g}), or use mixed_precision('bf16-true') (fp32's "
        "range), or 'fp16' (fp32 weights and state, with loss scaling).", RuntimeWarning)


def _refuse_engine(module: nn.Module, policy: str, engine_built: bool) -> None:
    """An engine built over the fp32 parameters (a first forward under distributed() before
    this scope opened, or the user's own DDP or fully_shard) would break if they changed
    dtype under it: refuse, naming the fix."""
    record = _records.module_record(module)
    built = engine_built or (record is not None and bool(record.engine))
    if not (built or isinstance(module, nn.parallel.DistributedDataParallel) or any(
            type(p).__name__ == "DTensor" for p in module.parameters())):
        return
    name = type(module).__name__
    raise ConfigurationError(
        f"mixed_precision({policy!r}) casts a model to half at its first forward, but this "
        f"{name} already has a data-parallel engine (DDP or FSDP2) built over its "
        "fp32 parameters (its first forward ran before the scope opened, or it was wrapped by "
        "hand). Open the scope before the model's first forward (with distributed(), "
        f"mixed_precision({policy!r}): ...), or cast it before wrapping it "
        "(model.to(torch.bfloat16)).")
