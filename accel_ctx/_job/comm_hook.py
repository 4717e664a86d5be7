"""``distributed(comm_hook=...)``: which of torch's DDP communication hooks, checked where given.

The hooks themselves are torch's (``torch.distributed.algorithms.ddp_comm_hooks``); this module
only names them, checks a choice before any process group forms, and builds a fresh hook state
per model (PowerSGD keeps per-bucket error feedback and its step count in its state).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch

from .._options import checked, flag, whole
from ..errors import ConfigurationError

COMM_HOOKS = ("bf16", "fp16", "powersgd")


@checked
@dataclass(frozen=True)
class PowerSGD:
    """torch's PowerSGD gradient compression with your settings: ``comm_hook=PowerSGD(...)``.

    Each model the scope adopts gets its own ``PowerSGDState`` built from these fields (a
    state shared by two models would mix their error feedback). ``comm_hook="powersgd"`` is
    ``PowerSGD()``: torch's defaults.

    Examples:
        >>> from accel_ctx import PowerSGD, distributed
        >>> with distributed(comm_hook=PowerSGD(rank=4, start_iter=100)):
        ...     pass
        >>> PowerSGD(rank=0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        accel_ctx.errors.ConfigurationError: PowerSGD(rank=0): give a whole number >= 1 ...
    """

    rank: int = 1
    """The low-rank approximation's rank (torch's ``matrix_approximation_rank``): higher is
    more accurate and sends more."""
    start_iter: int = 1_000
    """Plain all-reduce for the steps before this one, then compressed (torch's
    ``start_powerSGD_iter``; must be > 1 with error feedback or warm start)."""
    min_compression_rate: float = 2.0
    """Compress a tensor only when this saves at least this factor of bytes."""
    use_error_feedback: bool = True
    """Add each step's compression error to the next step's gradient."""
    warm_start: bool = True
    """Reuse the previous step's low-rank factors as the starting point."""
    batched: bool = False
    """torch's ``batched_powerSGD_hook``: one matrix per bucket (faster, less accurate)."""
    seed: int = 0
    """The random seed of the factors' initialisation (the same on every rank)."""

    def __post_init__(self) -> None:
        for name in ("rank", "start_iter"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(
                    f"PowerSGD({name}={value!r}): give a whole number >= 1 (torch's defaults: "
                    "rank=1, start_iter=1000).")
        whole("PowerSGD", "seed", self.seed, 0, "give the random seed, an int >= 0.")
        for name in ("use_error_feedback", "warm_start", "batched"):
            flag("PowerSGD", name, getattr(self, name))
        rate = self.min_compression_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
            raise ConfigurationError(
                f"PowerSGD(min_compression_rate={rate!r}): give a positive number (default 2).")
        if (self.use_error_feedback or self.warm_start) and self.start_iter <= 1:
            raise ConfigurationError(
                f"PowerSGD(start_iter={self.start_iter}): with error feedback or warm start "
                "torch's PowerSGD needs a few plain all-reduce steps first; give start_iter >= 2, "
                "or use_error_feedback=False and warm_start=False.")


CommHook: TypeAlias = "str | PowerSGD | tuple[Any, Any] | None"


def parse(value: Any) -> str | PowerSGD | tuple[Any, Any] | None:
    """The ``comm_hook=`` given, checked: a name, a :class:`PowerSGD`, or ``(state, hook)``."""
    if value is None or isinstance(value, PowerSGD):
        return value
    if isinstance(value, str) and value.lower() in COMM_HOOKS:
        return value.lower()
    if isinstance(value, tuple) and len(value) == 2 and callable(value[1]):
        return value
    close = difflib.get_close_matches(str(value).lower(), COMM_HOOKS, n=1)
    hint = f"did you mean {close[0]!r}? " if close and isinstance(value, str) else ""
    raise ConfigurationError(
        f"distributed(comm_hook={value!r}): {hint}give 'bf16', 'fp16', 'powersgd', "
        "PowerSGD(rank=..., ...), a (state, hook) pair as DDP's register_comm_hook takes, "
        "or None.")


def check_device(spec: str | PowerSGD | tuple[Any, Any] | None, device: torch.device) -> None:
    """torch's bf16 hook runs on NCCL (or XPU) only; said before any process group forms."""
    if spec == "bf16" and device.type not in ("cuda", "xpu"):
        raise ConfigurationError(
            f"distributed(comm_hook='bf16') cannot run on {device.type}: torch's bf16 hook "
            "needs CUDA with NCCL 2.10+ (or XPU). Use comm_hook='fp16' here, or run on GPUs.")


def torch_hook(spec: str | PowerSGD | tuple[Any, Any]) -> tuple[Any, Any]:
    """The ``(state, hook)`` to register on one model: a fresh state each call."""
    if isinstance(spec, tuple):
        return spec
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if spec == "bf16":
        return None, default_hooks.bf16_compress_hook
    if spec == "fp16":
        return None, default_hooks.fp16_compress_hook
    options = spec if isinstance(spec, PowerSGD) else PowerSGD()
    state = powerSGD_hook.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=options.rank,
        start_powerSGD_iter=options.start_iter,
        min_compression_rate=options.min_compression_rate,
        use_error_feedback=options.use_error_feedback,
        warm_start=options.warm_start,
        random_seed=options.seed,
    )
    hook = powerSGD_hook.batched_powerSGD_hook if options.batched else powerSGD_hook.powerSGD_hook
    return state, hook
