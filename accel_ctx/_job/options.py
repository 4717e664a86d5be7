"""``distributed()``'s options: parsed and checked when given (the device and backend they
lead to are chosen at entry: ``_job.placement``).

Every check runs in one process too, so a typo fails on the laptop, not on the cluster; each
message names the option, the value given and what to pass instead.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any, TypedDict

import torch
import torch.distributed as dist

from .._options import flag, unknown_option
from ..errors import ConfigurationError
from . import comm_hook as _comm_hook
from .comm_hook import PowerSGD
from .sequence import sequence_options
from .stages import pipeline_options
from .tp_plan import tp_options

DEFAULT_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class DistributedOptions:
    """How ``distributed()`` sets up the job and wraps modules in DDP's machinery."""

    backend: str | None = None
    """``"gloo"``, ``"nccl"``, or None: NCCL (with gloo for CPU tensors) on CUDA, else gloo."""
    device: str | None = None
    """Force a device ("cpu", "cuda:1", ...); None picks cuda:LOCAL_RANK, else mps, else cpu."""
    timeout: timedelta = DEFAULT_TIMEOUT
    """How long rendezvous and each collective may wait before failing with an error."""
    init_method: str | None = None
    """A ``file://``, ``tcp://`` or ``env://`` rendezvous URL; None uses MASTER_ADDR/MASTER_PORT."""
    find_unused_parameters: bool = False
    """DDP: allow parameters that receive no gradient in some steps."""
    static_graph: bool = False
    """DDP: the set of used parameters never changes (enables optimisations)."""
    broadcast_buffers: bool = True
    """DDP: copy rank 0's buffers (e.g. BatchNorm statistics) to all ranks every forward."""
    bucket_cap_mb: float | None = None
    """DDP: gradient bucket size in MiB (None: DDP's default of 25)."""
    gradient_as_bucket_view: bool = False
    """DDP: let ``.grad`` alias the communication buckets (saves memory)."""
    sync_batchnorm: bool = False
    """Use SyncBatchNorm statistics across ranks for the scope (restored on exit)."""
    even_batches: bool = True
    """Pad the last round of batches by wrapping around so every rank gets as many batches.

    False keeps the exact tail (ranks may get one batch fewer; training on it runs under DDP's
    Join). A loader with ``drop_last=True`` drops the incomplete round either way."""
    debug: bool = False
    """Check collectives' shapes across ranks first (also on with ACCEL_CTX_DEBUG=1)."""
    comm_hook: str | PowerSGD | tuple[Any, Any] | None = None
    """DDP: compress gradients in the all-reduce with torch's own hook: ``"bf16"``, ``"fp16"``,
    ``"powersgd"`` (torch's defaults) or :class:`PowerSGD` with your settings (a fresh state per
    model), or ``(state, hook)`` for any DDP comm hook (that one state serves every model);
    registered on every model the scope adopts. Not with ``sharded()``."""
    tp: int | None = None
    """Tensor parallelism: split each planned layer's weights over groups of this many
    consecutive ranks (the data splits over the groups: ``state().dp_size`` = world / tp).
    ``distributed(tp=N)`` alone needs world = N; ``sharded(tp=N)`` shards over the groups."""
    tp_plan: tuple[tuple[str, Any], ...] | None = None
    """Where tensor parallelism applies: module path patterns (``*`` = one segment) to
    ``"colwise"``, ``"rowwise"`` or a torch ``ParallelStyle``; None uses the plan the model
    declares (transformers' ``_tp_plan`` / ``config.base_model_tp_plan``)."""
    loss_parallel: bool = False
    """With ``tp``: the output layer's logits stay split on the vocabulary (a DTensor) and the
    loss and its backward compute on the shards (torch's ``loss_parallel()``, in the scope)."""
    sp: int | None = None
    """Sequence parallelism (Ulysses): groups of this many consecutive ranks split each sequence."""
    cp: int | None = None
    """Context parallelism: as ``sp``, attention by torch's ring attention (CUDA devices only)."""
    pp: int | None = None
    """Pipeline parallelism: cut each model into this many stages, one per rank of a pipeline
    of consecutive ranks (the data splits over the pipelines: ``state().dp_size`` = world / pp)."""
    microbatches: int | None = None
    """With ``pp``: the micro-batches each batch is cut into, run through the stages in turn
    (GPipe); default one per stage."""
    schedule: str | None = None
    """With ``pp``: ``"gpipe"`` (default) or ``"1f1b"`` (needs ``loss_fn``)."""
    loss_fn: Callable[[Any, Any], Any] | None = None
    """With ``pp``: the loss of (output, target); a call ``model(x, target=y)`` then runs
    torch's schedule, backward included, and returns the loss."""
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)  # Job.nested


class Options(TypedDict, total=False):
    backend: str | None
    device: str | torch.device | None
    timeout: timedelta | float
    init_method: str | None
    find_unused_parameters: bool
    static_graph: bool
    broadcast_buffers: bool
    bucket_cap_mb: float | None
    gradient_as_bucket_view: bool
    sync_batchnorm: bool
    even_batches: bool
    debug: bool
    comm_hook: str | PowerSGD | tuple[Any, Any] | None
    tp: int | None
    tp_plan: Mapping[str, Any] | None
    loss_parallel: bool
    sp: int | None
    cp: int | None
    pp: int | None
    microbatches: int | None
    schedule: str | None
    loss_fn: Callable[[Any, Any], Any] | None


OPTION_NAMES = tuple(f.name for f in fields(DistributedOptions) if f.name != "given")
_FLAGS = ("find_unused_parameters", "static_graph", "broadcast_buffers",
          "gradient_as_bucket_view", "sync_batchnorm", "even_batches", "debug")
_SCHEMES = ("file://", "tcp://", "env://")


def _bad(name: str, value: Any, fix: str) -> ConfigurationError:
    return ConfigurationError(f"distributed({name}={value!r}): {fix}")


def _timeout(value: Any) -> timedelta:
    fix = "give a positive, finite number of seconds or a timedelta (e.g. timeout=600)."
    if isinstance(value, bool) or not isinstance(value, (int, float, timedelta)):
        raise _bad("timeout", value, fix)
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not math.isfinite(seconds) or seconds <= 0:
        raise _bad("timeout", value, fix)
    try:
        return value if isinstance(value, timedelta) else timedelta(seconds=seconds)
    except OverflowError:
        raise _bad("timeout", value, fix) from None


def known_backends() -> list[str]:
    """Backend names torch knows (built in or registered by a plugin)."""
    names = [str(n) for n in getattr(dist.Backend, "backend_list", ["gloo", "nccl", "mpi"])]
    return [n for n in names if n not in ("undefined", "fake")]


def _backend(value: Any) -> str | None:
    if value is None:
        return None
    known = known_backends()
    fix = (f"give one of {', '.join(repr(n) for n in known)}, a per-device mapping like "
           "'cpu:gloo,cuda:nccl', or None to pick one that works on the device.")
    if not isinstance(value, str):
        raise _bad("backend", value, fix)
    for part in value.lower().split(","):
        device, _, name = part.strip().rpartition(":")
        if name not in known or (device and device not in ("cpu", "cuda", "xpu", "hpu", "mps")):
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close and close[0] != name else ""
            raise _bad("backend", value, hint + fix)
    return value.lower()


def _device(value: Any) -> str | None:
    if value is None:
        return None
    fix = "give a device like 'cpu', 'cuda', 'cuda:1' or 'mps', or None to pick the best one."
    if not isinstance(value, (str, torch.device)):
        raise _bad("device", value, fix)
    try:
        return str(torch.device(value))
    except (RuntimeError, ValueError):
        raise _bad("device", value, fix) from None


def _init_method(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.startswith(_SCHEMES):
        raise _bad("init_method", value, "give a rendezvous URL: 'file:///shared/path', "
                   "'tcp://host:port' or 'env://', or None to use MASTER_ADDR/MASTER_PORT.")
    return value


def _bucket_cap(value: Any) -> float | None:
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise _bad("bucket_cap_mb", value,
                   "give a positive number of MiB (DDP's default is 25), or None.")
    return float(value)


def parse_options(options: Mapping[str, Any], call: str = "distributed",
                  own: tuple[str, ...] = ()) -> DistributedOptions:
    """Check every option where it is given; raises ConfigurationError naming option and fix.

    ``call`` and its ``own`` options name the scope that took them (``sharded()``)."""
    for name in options:
        if name not in OPTION_NAMES:
            raise unknown_option(call, name, own + OPTION_NAMES)
    values = dict(options)
    values["timeout"] = _timeout(values.get("timeout", DEFAULT_TIMEOUT))
    values["device"] = _device(values.get("device"))
    values["backend"] = _backend(values.get("backend"))
    values["init_method"] = _init_method(values.get("init_method"))
    values["bucket_cap_mb"] = _bucket_cap(values.get("bucket_cap_mb"))
    values["comm_hook"] = _comm_hook.parse(values.get("comm_hook"))
    values.update(tp_options(values, call))
    values.update(sequence_options(values, call))
    values.update(pipeline_options(values, call))
    for name in _FLAGS:
        if name in values:
            flag(call, name, values[name])
    return DistributedOptions(**values, given=frozenset(options))


def check_nested(outer_device: torch.device, outer_backend: str | None,
                 outer: DistributedOptions, options: DistributedOptions) -> None:
    """A nested ``distributed()`` shares the outer job: it cannot change how the job was set up."""
    wanted: list[tuple[str, Any, Any]] = []
    if options.device is not None:
        device = torch.device(options.device)
        same = device == outer_device or (device.index is None and device.type == outer_device.type)
        if not same:
            wanted.append(("device", options.device, str(outer_device)))
    if options.backend is not None and options.backend != (outer_backend or outer.backend):
        wanted.append(("backend", options.backend, outer_backend or outer.backend))
    if options.init_method is not None and options.init_method != outer.init_method:
        wanted.append(("init_method", options.init_method, outer.init_method))
    if wanted:
        name, value, current = wanted[0]
        raise ConfigurationError(
            f"distributed({name}={value!r}) is nested inside a distributed() scope that already "
            f"set up the job with {name}={current!r}; a nested scope cannot change it. Pass "
            f"{name}= to the outermost distributed(), or drop it from the nested one."
        )
