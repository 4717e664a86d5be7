"""``mixed_precision("fp8")``: torchao's float8 training for the Linear layers, bf16 for the rest.

A model's first top-level call in the scope converts it in place with torchao's
``convert_to_float8_training``: each ``nn.Linear`` whose in and out features are multiples of 16
(float8 matmuls need them) and that the user's ``fp8_filter(module, name)`` accepts becomes a
``Float8Linear`` holding the very same weight and bias ``Parameter`` objects, so optimizers made
before keep training them and ``state_dict()`` keys do not change. Everything else runs under
bf16 autocast, exactly as ``mixed_precision("bf16")`` runs it (this runtime is a
:class:`~accel_ctx._precision.runtime.PrecisionRuntime` in bf16).

The conversion comes before the data-parallel engine sees the model (``order`` below the
distributed concern's): DDP replicates, and FSDP2 shards, the converted model, as torchao's
recipe does it by hand (convert, then ``fully_shard``). Under ``sharded()`` the weights are then
gathered in float8 (torchao's ``WeightWithDynamicFloat8CastTensor``, which its
``enable_fsdp_float8_all_gather`` applies), wrapped in :meth:`Fp8Runtime.before_sharding` after
the engine noted the parameters the optimizers know, so that they follow the shards.

torchao is imported at the first conversion, never by ``import accel_ctx``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import logging
import sys
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from .._kernel import state as _state
from .._kernel.concern import ForwardCall
from .._kernel.order import ORDER
from .._kernel.session import Session
from .._warn import warn_user
from ..errors import ArgumentError, ConfigurationError
from .runtime import PrecisionPolicy, PrecisionRuntime

Fp8Filter = Callable[[nn.Module, str], bool]
"""``fp8_filter(module, name)``: False keeps that ``nn.Linear`` (qualified name ``name`` in the
model) in bf16; torchao's ``module_filter_fn`` has the same shape."""

INSTALL = 'pip install "accel-ctx[fp8]"'

_converted: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""The models converted in this process (a forked child holds the same converted objects)."""
_ours: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""The Float8Linear layers made here (a model holding others was converted by its user)."""
_optimizers_checked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_gathered_in_fp8: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""The Float8Linear layers whose weights we wrapped for float8 all-gathers (sharded())."""


def require_torchao(asked: str = "mixed_precision('fp8')") -> None:
    """Refuse fp8 where torchao is not installed (found without importing it)."""
    try:
        found = importlib.util.find_spec("torchao") is not None
    except (ImportError, ValueError):  # a stand-in module in sys.modules
        found = False
    if not found:
        raise ConfigurationError(
            f"{asked} trains the Linear layers with torchao's float8 training, and torchao "
            f"is not installed. Install it with {INSTALL} (or pip install torchao), or use "
            "mixed_precision('bf16').")


@dataclasses.dataclass(frozen=True)
class Fp8Options:
    """What ``mixed_precision("fp8", ...)`` asks of the conversion."""

    filter: Fp8Filter | None = None
    """Called as ``filter(module, name)`` for each qualifying Linear; False leaves it in bf16."""
    config: Any = None
    """A ``torchao.float8.Float8LinearConfig`` (None: torchao's default, tensorwise scaling).
    Its ``enable_fsdp_float8_all_gather`` applies under ``sharded()``; without a config the
    weights are gathered in float8 there."""


def check_options(fp8_filter: object, fp8_config: object, policy: str | None
                  ) -> Fp8Options | None:
    """The fp8 options given to ``mixed_precision(policy, ...)`` (None: none given), checked."""
    if fp8_filter is None and fp8_config is None:
        return None
    if policy not in (None, "fp8"):
        _not_fp8(policy, "fp8_filter" if fp8_filter is not None else "fp8_config")
    if fp8_filter is not None and not callable(fp8_filter):
        raise ConfigurationError(
            f"mixed_precision(fp8_filter={fp8_filter!r}): give a function (module, name) -> "
            "bool that says which Linear layers train in float8, e.g. "
            "fp8_filter=lambda module, name: name != 'lm_head'.")
    if fp8_filter is not None:
        _check_filter_signature(fp8_filter)
    if fp8_config is not None and not _is_float8_config(fp8_config):
        raise ConfigurationError(
            f"mixed_precision(fp8_config={fp8_config!r}): give a torchao "
            "torchao.float8.Float8LinearConfig (e.g. Float8LinearConfig.from_recipe_name("
            "'rowwise')), or None for torchao's default recipe.")
    return Fp8Options(fp8_filter, fp8_config)


def _check_filter_signature(fp8_filter: Callable[..., Any]) -> None:
    """torchao calls the filter as ``filter(module, fqn)``: one taking another number of
    arguments is refused here, not by a bare TypeError inside the model's first forward."""
    try:
        inspect.signature(fp8_filter).bind(nn.Module(), "")
    except ValueError:  # no signature to read (a builtin): its first call will tell
        return
    except TypeError as error:
        name = getattr(fp8_filter, "__name__", type(fp8_filter).__name__)
        raise ArgumentError(
            f"mixed_precision('fp8', fp8_filter={name}): the filter is called as "
            f"fp8_filter(module, name) for each Linear layer (torchao's module_filter_fn), and "
            f"{name}{inspect.signature(fp8_filter)} cannot take those two arguments ({error}). "
            "Give it both, e.g. fp8_filter=lambda module, name: name != 'lm_head'.") from None


_NOISE = (("torchao", "Failed to load"),  # its CUDA kernels, on a host without CUDA
          ("torch.utils._pytree", "is an Enum subclass and is now natively supported"))
"""What importing torchao logs on a correct run: the logger and a part of each line."""


def import_torchao() -> None:
    """Import ``torchao.float8`` (once per process) without the lines its import logs on a
    correct run: its CUDA libraries failing to load where there is no CUDA, and torch's
    deprecation of its Enum registration. Only around our own import; others pass."""
    if "torchao.float8" in sys.modules:
        return
    noise = [(name, text) for name, text in _NOISE
             if name != "torchao" or not torch.cuda.is_available()]

    def keep(record: logging.LogRecord) -> bool:
        return not any(record.name == name and text in record.getMessage()
                       for name, text in noise)

    loggers = [logging.getLogger(name) for name, _ in noise]
    for logger in loggers:
        logger.addFilter(keep)
    try:
        import torchao.float8  # noqa: F401
    finally:
        for logger in loggers:
            logger.removeFilter(keep)


def _is_float8_config(value: object) -> bool:
    require_torchao("mixed_precision(fp8_config=...)")
    import_torchao()
    from torchao.float8 import Float8LinearConfig  # imported already: the config is made of it

    return isinstance(value, Float8LinearConfig)


class Fp8Runtime(PrecisionRuntime):
    """The live side of a ``mixed_precision("fp8")`` entry: bf16 autocast, and each model's
    Linear layers converted to torchao's ``Float8Linear`` at its first call."""

    order = ORDER["fp8"]

    def __init__(self, policy: PrecisionPolicy, device_type: str | None,
                 options: Fp8Options | None = None) -> None:
        require_torchao()
        super().__init__(policy, device_type)
        self.options = options or Fp8Options()

    @override
    def _check(self, device_type: str) -> None:
        if device_type not in self._checked and device_type == "cuda" and (
                torch.cuda.get_device_capability() < (8, 9)):
            name = torch.cuda.get_device_name()
            raise ConfigurationError(
                f"mixed_precision('fp8') needs float8 matmuls, which this GPU ({name}) lacks: "
                "they need compute capability 8.9 or newer (Ada, Hopper, Blackwell). Use "
                "mixed_precision('bf16') here.")
        super()._check(device_type)

    @override
    def before_forward(self, call: ForwardCall, session: Session) -> None:
        module = call.module
        if module not in _converted:
            self.convert(module)

    @override
    def prepare_for_load(self, objects: dict[str, Any], session: Session) -> None:
        # converted before the engine shards them for the load, as their first call would
        for obj in objects.values():
            if isinstance(obj, nn.Module) and obj not in _converted:
                self.convert(obj)

    @override
    def skips_step(self, optimizer: torch.optim.Optimizer) -> bool | torch.Tensor:
        if optimizer not in _optimizers_checked:  # once: its parameters are final by now
            _optimizers_checked.add(optimizer)
            _refuse_compiled_low_bit(optimizer)
        return super().skips_step(optimizer)

    @override
    def before_sharding(self, module: nn.Module) -> None:
        config = self.options.config
        if config is not None and not config.enable_fsdp_float8_all_gather:
            return
        gather_in_float8(module)

    def convert(self, module: nn.Module) -> None:
        """Convert ``module``'s qualifying Linear layers in place (once per model)."""
        coordinates = _state.coordinates()
        if coordinates.tp_size > 1:
            raise ConfigurationError(
                f"mixed_precision('fp8') with tp={coordinates.tp_size}: float8 training of "
                "tensor-parallel layers needs torchao's own parallel styles, which accel_ctx "
                "does not apply yet. Use mixed_precision('bf16') with tp=, or fp8 without tp=.")
        inner = _inner(module)
        converted, left_out = convert(inner, self.options)
        _converted.update((module, inner))  # once converted: a refusal comes again next call
        if not converted and left_out and coordinates.rank == 0:
            warn_user(
                f"mixed_precision('fp8'): no Linear layer of this {type(inner).__name__} trains "
                f"in float8, so it trains in bf16 only: {left_out}.")


def _inner(module: nn.Module) -> nn.Module:
    """The user's model inside a compiled wrapper (``torch.compile(model)``) or their own DDP:
    converted with the user's names, not ``_orig_mod.`` or ``module.`` ones."""
    while True:
        inner = module._modules.get("_orig_mod")
        if inner is None and isinstance(module, nn.parallel.DistributedDataParallel):
            inner = module.module
        if inner is None:
            return module
        module = inner


def convert(module: nn.Module, options: Fp8Options) -> tuple[int, str]:
    """Swap the qualifying Linear layers of ``module`` for Float8Linear. Returns how many are
    Float8Linear now, and why the first Linear left out for its sizes was (or "")."""
    from torch.distributed.tensor import DTensor

    import_torchao()
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    user = options.filter
    chosen: list[str] = []
    left_out: list[str] = []

    def qualifies(sub: nn.Module, name: str) -> bool:
        if isinstance(sub, Float8Linear) or not isinstance(sub, nn.Linear):
            return False  # converted before (a part called first) or no Linear
        if not name:  # the root cannot be swapped in place: it stays the user's object
            left_out.append("the model is itself a Linear, which stays the object you made "
                            "(float8 replaces the Linear layers inside a model); call it in a "
                            "module, e.g. nn.Sequential(layer)")
            return False
        if sub.in_features % 16 or sub.out_features % 16:
            left_out.append(f"{name} is {sub.in_features} -> {sub.out_features}, and float8 "
                            "matmuls need in and out features that are multiples of 16; give "
                            "the layers such sizes, or use mixed_precision('bf16')")
            return False
        if user is not None and not user(sub, name):
            return False
        if isinstance(sub.weight, DTensor):
            raise ConfigurationError(
                f"mixed_precision('fp8'): {name} of this {type(module).__name__} was already "
                "sharded or split (its weight is a DTensor), and float8 conversion must come "
                "first. Let sharded() shard the model inside the fp8 scope (its first call "
                "converts, then shards), or convert it yourself with torchao's "
                "convert_to_float8_training before fully_shard.")
        chosen.append(name)
        return True

    layers = [sub for sub in module.modules() if isinstance(sub, Float8Linear)]
    if any(sub not in _ours for sub in layers):
        return -1, ""  # the user converted it with torchao: their choice of layers stands
    config = options.config or Float8LinearConfig()
    # the float8 all-gather wrapper replaces the weight Parameter: it is applied at sharding
    config = dataclasses.replace(config, enable_fsdp_float8_all_gather=False)
    convert_to_float8_training(module, module_filter_fn=qualifies, config=config)
    _ours.update(sub for sub in module.modules() if isinstance(sub, Float8Linear))
    # a part called on its own first was converted then: not "nothing qualifies"
    return len(chosen) + len(layers), left_out[0] if left_out else ""


def gather_in_float8(module: nn.Module) -> None:
    """Wrap the weights of ``module``'s Float8Linear layers as torchao's
    ``enable_fsdp_float8_all_gather`` does, so FSDP2 gathers them in float8 (tensorwise
    dynamic scaling only; a weight tied to another module is left as it is)."""
    from torchao.float8.config import ScalingGranularity, ScalingType
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    uses = Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))
    for sub in module.modules():
        if not isinstance(sub, Float8Linear) or sub not in _ours or sub in _gathered_in_fp8:
            continue
        weight = sub.weight
        cast = sub.config.cast_config_weight
        if (uses[id(weight)] > 1 or cast.scaling_type is not ScalingType.DYNAMIC
                or cast.scaling_granularity is not ScalingGranularity.TENSORWISE):
            continue
        sub.weight = nn.Parameter(
            WeightWithDynamicFloat8CastTensor(weight, sub.linear_mm_config, cast.target_dtype),
            requires_grad=weight.requires_grad)
        _gathered_in_fp8.add(sub)


def _refuse_compiled_low_bit(optimizer: torch.optim.Optimizer) -> None:
    """torchao's low-bit optimizers compile their update per parameter, and torch 2.13's
    compiler crashes the process (a segmentation fault in the compiled kernel, on the CPU) on a
    sharded weight wrapped for float8 all-gathers: refused before the first step."""
    if not type(optimizer).__module__.startswith("torchao.optim"):
        return
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    for group in optimizer.param_groups:
        for param in group["params"]:
            local = getattr(param, "_local_tensor", param)
            if isinstance(local, WeightWithDynamicFloat8CastTensor):
                raise ConfigurationError(
                    f"torchao's {type(optimizer).__name__} compiles its update with "
                    "torch.compile, and torch's compiler crashes the process on the weights "
                    "that mixed_precision('fp8') gathers in float8 under sharded(). Gather them "
                    "in bf16: mixed_precision('fp8', fp8_config=Float8LinearConfig()) "
                    "(torchao.float8; its enable_fsdp_float8_all_gather is off), or use "
                    "torch.optim.AdamW.")


def runtime_for(policy: PrecisionPolicy, device_type: str | None,
                options: Fp8Options | None = None) -> PrecisionRuntime:
    """The runtime of a ``mixed_precision()`` entry (or the launcher's default) for ``policy``."""
    if policy.name == "fp8":
        return Fp8Runtime(policy, device_type, options)
    if options is not None:  # the launcher's policy was not fp8
        _not_fp8(policy.name, "fp8_filter" if options.filter is not None else "fp8_config")
    return PrecisionRuntime(policy, device_type)


def _not_fp8(policy: str, given: str) -> None:
    raise ConfigurationError(
        f"mixed_precision({policy!r}, {given}=...): {given} chooses how the Linear layers "
        "train in float8, which only mixed_precision('fp8') does. Drop it, or ask for 'fp8'.")
