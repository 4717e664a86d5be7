"""``distributed()``: the launch environment, the process group, the device, adopted modules."""

from __future__ import annotations

import gc
import inspect
import os
import weakref
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import PrefixStore, Store
from typing_extensions import Unpack

from . import _env, _rendezvous, _state
from ._dist_options import (
    DEFAULT_TIMEOUT,
    DistributedOptions,
    Options,
    check_backend,
    check_nested,
    parse_options,
    pick_backend,
    pick_device,
)
from ._progress import Heartbeat, Progress, watch
from ._scope import Scope
from ._tree import to_device
from ._warn import warn_user
from .errors import (
    DistributedError,
    LaunchEnvironmentError,
    RendezvousError,
)

if TYPE_CHECKING:
    from ._precision import PrecisionRuntime

_LAST_FORWARD = "_accel_ctx_last_forward"  # see _join.LAST_FORWARD
_BUFFER_SYNC_FLAG = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(nn.parallel.DistributedDataParallel).parameters
    else "broadcast_buffers"
)
# Re-exported: the options live with their checks in _dist_options.
__all__ = ["DEFAULT_TIMEOUT", "DistributedOptions", "DistributedRuntime", "distributed"]


class distributed(Scope):
    """Run the enclosed training code data-parallel on every process of the job.

    Reads the launch environment (``accel-ctx launch``/torchrun, SLURM, Open MPI; none means
    one process), joins the process group, picks the device (``cuda:LOCAL_RANK``, else mps,
    else cpu) and, inside the scope:

    * iterating any DataLoader yields this rank's share of the batches, on the device;
    * the first top-level call of a module with trainable parameters moves it to the device,
      starts every rank from rank 0's weights and averages its gradients with DDP's engine,
      while ``model`` stays the very same object (class, attributes, ``state_dict`` keys).

    Everything it set up is torn down on exit, also on an exception. Nesting is harmless;
    scopes one after another (train, then evaluate; a sweep) each get a fresh setup.

    Options (keyword-only): ``backend``, ``device``, ``timeout`` (seconds or timedelta),
    ``init_method``, ``find_unused_parameters``, ``static_graph``, ``broadcast_buffers``,
    ``bucket_cap_mb``, ``gradient_as_bucket_view``, ``sync_batchnorm``, ``even_batches``,
    ``debug`` (see :class:`DistributedOptions`).

    Example:
        >>> import torch
        >>> from accel_ctx import distributed, state
        >>> with distributed():
        ...     model = torch.nn.Linear(4, 2)
        ...     out = model(torch.randn(3, 4))
        ...     print(state().world_size, out.shape)
        1 torch.Size([3, 2])
    """

    concern = "distributed"

    def __init__(self, **options: Unpack[Options]) -> None:
        super().__init__()
        self.options = parse_options(options)

    def _open(self, exits: ExitStack) -> DistributedRuntime:
        below = _state.current()
        if below is not None and below.dist is not None:
            outer = below.dist
            check_nested(outer.device, outer.backend, outer.base.options, self.options)
            return DistributedRuntime.nested(outer, self.options)
        runtime = DistributedRuntime.start(self.options, exits)
        return runtime


def _store_key(launch: _env.LaunchEnv, options: DistributedOptions) -> tuple[str, int, int]:
    init_method = options.init_method or launch.init_method
    target = init_method or f"tcp://{launch.master_addr}:{launch.master_port}"
    return (target, launch.rank, launch.world_size)


def _init_process_group(
    launch: _env.LaunchEnv, options: DistributedOptions, backend: str, device: torch.device
) -> None:
    """Reach the store, wait there for every rank (with progress lines), form the group."""
    init_method = options.init_method or launch.init_method
    address = _rendezvous.address_of(launch, init_method)
    where = f"rank {launch.rank} of {launch.world_size} ({launch.source}, rendezvous at {address})"
    seconds = options.timeout.total_seconds()
    check_backend(backend, device)
    waiter = _rendezvous.Waiter(launch, address, options.timeout)
    key = _store_key(launch, options)
    try:
        base: Store | None = _state.cached_store(key)
        if base is None:
            base = _rendezvous.connect(launch, init_method, options.timeout, waiter)
        # A fresh key prefix per process group: sequential scopes and elastic restarts reuse
        # the same store, and must not see each other's barrier counters.
        generation = _state.next_pg_generation()
        store = PrefixStore(f"accel_ctx/{launch.restart_count}/{generation}", base)
        _rendezvous.await_peers(store, launch, waiter)
        dist.init_process_group(
            backend,
            store=store,
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=options.timeout,
        )
        # Kept for the process's next scopes only once a group formed with it.
        _state.cache_store(key, base)
    except (RendezvousError, LaunchEnvironmentError):
        raise
    except Exception as exc:
        if waiter.left() > 0.1 * seconds and "timeout" not in str(exc).lower():
            raise DistributedError(
                f"{where}: the process group could not be set up: {exc}"
            ) from exc
        raise RendezvousError(
            f"{where}: the process group did not form within {seconds:g} s ({exc}). Check that "
            f"all {launch.world_size} processes were started with the same MASTER_ADDR/"
            "MASTER_PORT and can reach rank 0; raise distributed(timeout=...) if start-up is slow."
        ) from exc


class DistributedRuntime:
    """The live side of one ``distributed()`` entry (shared by scopes nested inside it)."""

    def __init__(
        self,
        launch: _env.LaunchEnv,
        device: torch.device,
        backend: str | None,
        options: DistributedOptions,
        base: DistributedRuntime | None,
    ) -> None:
        self.launch = launch
        self.device = device
        self.backend = backend
        self.options = options
        self.base: DistributedRuntime = base if base is not None else self
        self.rank = launch.rank
        self.world_size = launch.world_size
        self.debug = options.debug or os.environ.get(_env.DEBUG_VAR, "") not in ("", "0")
        self.default_precision: PrecisionRuntime | None = (
            base.default_precision if base is not None else None
        )
        # Modules this (base) runtime adopted; records live on the modules themselves.
        self.adopted: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._undo_batchnorm: list[tuple[nn.Module, str, nn.Module]] = []
        self._warned_batchnorm = False
        self._replaced: dict[int, tuple[weakref.ref[nn.Parameter], nn.Parameter]] = {}
        self._parts_checked: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        # where this rank is (step, phase), for the other ranks' failure messages (_blame)
        self.progress: Progress = base.progress if base is not None else Progress()
        self.heartbeat: Heartbeat | None = None
        # DDP forwards with gradients so far (numbers them for _join), and the refusal a
        # forward gets in an uneven last round that no Join covers (even_batches=False)
        self.ddp_forwards = 0
        self.uneven_tail: str | None = None

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def start(cls, options: DistributedOptions, exits: ExitStack) -> DistributedRuntime:
        from ._precision import precision_from_env

        launch = _env.detect()
        backend: str | None = None
        if dist.is_available() and dist.is_initialized():
            # The user (or a library) already formed the group: use it, leave it to them.
            launch = _launch_from_group(launch)
            device = pick_device(options, launch)
            backend = str(dist.get_backend())
        else:
            device = pick_device(options, launch)
            if launch.is_distributed:
                backend = pick_backend(options, device)
                _init_process_group(launch, options, backend, device)
                exits.callback(dist.destroy_process_group)
        if device.type == "cuda":
            previous = torch.cuda.current_device()
            torch.cuda.set_device(device)
            exits.callback(torch.cuda.set_device, previous)
        runtime = cls(launch, device, backend, options, None)
        exits.callback(runtime._release_modules)
        watch(runtime, exits)  # publish its progress; announce its exit to the other ranks
        runtime.default_precision = precision_from_env(device, exits)
        return runtime

    @classmethod
    def nested(cls, outer: DistributedRuntime, options: DistributedOptions) -> DistributedRuntime:
        return cls(outer.launch, outer.device, outer.backend, options, outer.base)

    # ---- modules -------------------------------------------------------------------------------
    def prepare(self, module: nn.Module, grad: bool) -> tuple[Any, Any]:
        """What to call for a top-level call of ``module``, and its DDP engine (or None).

        The engine is built at the first call with gradients enabled, and calls without
        gradients run the module itself: an evaluation or a preview in rank-only code (no
        backward to synchronise) then runs no collective that other ranks would have to join.
        """
        record = _state.module_record(module)
        if record is None or record.owner is not self.base:
            if isinstance(module, nn.parallel.DistributedDataParallel):
                return module, module  # the user's own DDP: leave it to them
            if _managed_elsewhere(module):
                return module, None
            record = self._adopt(module)
        if not record.root:  # a part of an adopted model, called on its own
            if grad and self.world_size > 1:
                self.base._check_part(module)
            return module, None
        if not grad:
            return module, None
        if self.world_size > 1 and _state.rank_only() is not None:
            # Rank-only code: DDP's collectives would wait for ranks that never come. Run the
            # module itself; a backward through it is refused (_patches._backward).
            self.progress.armed = bool(record.engine) or (
                record.engine is None and any(p.requires_grad for p in module.parameters()))
            return module, None
        base = self.base
        if base.uneven_tail is not None and (record.engine or (
            record.engine is None and any(p.requires_grad for p in module.parameters())
        )):
            from ._join import refuse_forward

            refuse_forward(base)
        if record.engine is None:  # decided once, at the first call that records gradients
            record.engine = self._engine_for(module) or False
        engine = record.engine
        if not engine:
            return module, None
        base.ddp_forwards += 1
        engine.__dict__[_LAST_FORWARD] = base.ddp_forwards
        return engine, engine

    def _adopt(self, module: nn.Module) -> _state.ModuleRecord:
        base = self.base
        for sub in module.modules():
            record = _state.module_record(sub)
            if sub is not module and record is not None and record.root and record.owner is base:
                base._release(sub)  # a part was called first; the whole model takes over
        self._move(module)
        root = _state.ModuleRecord(base, True)
        for sub in module.modules():
            _state.set_module_record(sub, root if sub is module else _state.ModuleRecord(base, False))
        base.adopted.add(module)
        return root

    def _check_part(self, part: nn.Module) -> None:
        if part in self._parts_checked:
            return
        self._parts_checked.add(part)
        if self.rank == 0 and any(p.requires_grad for p in part.parameters()):
            warn_user(
                f"a {type(part).__name__} inside an adopted model was called on its own with "
                "gradients enabled: DDP averages gradients only for calls of the whole model, "
                "so the gradients of this call stay local to each rank and the ranks drift "
                "apart. Call the model itself (move this use into its forward), or wrap the "
                "call in torch.no_grad() if no gradients are needed.",
                RuntimeWarning)

    def _engine_for(self, module: nn.Module) -> nn.parallel.DistributedDataParallel | None:
        trainable = any(p.requires_grad for p in module.parameters())
        engine = None
        base = self.base
        if trainable and self.world_size > 1 and dist.is_initialized():
            if self.options.sync_batchnorm and self.device.type in ("cuda", "xpu"):
                base._undo_batchnorm.extend(_convert_batchnorm(module))
            elif self.options.sync_batchnorm and not base._warned_batchnorm:
                base._warned_batchnorm = True
                if self.rank == 0:
                    warn_user(
                        f"distributed(sync_batchnorm=True): SyncBatchNorm cannot run on "
                        f"{self.device.type}; BatchNorm statistics stay per rank here. It takes "
                        "effect on CUDA devices.",
                        RuntimeWarning)
            engine = self._ddp(module)
        return engine

    def _move(self, module: nn.Module) -> None:
        if self.device.type == "cpu":
            return
        devices = {t.device.type for t in module.parameters()}
        devices.update(t.device.type for t in module.buffers())
        if devices != {"cpu"}:  # modules the user placed themselves stay where they are
            return
        before = dict(module.named_parameters())
        module.to(self.device)
        # Some devices (meta, XLA, ...) get new Parameter objects: optimizers made before the
        # move are pointed at them when accel_ctx first meets the optimizer.
        for name, param in module.named_parameters():
            old = before.get(name)
            if old is not None and old is not param:
                self.base._replaced[id(old)] = (weakref.ref(old), param)

    def adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Point an optimizer at moved parameters and move its state along with them."""
        replaced = self._replaced
        for group in optimizer.param_groups:
            for i, old in enumerate(group["params"]):
                entry = replaced.get(id(old))
                if entry is None or entry[0]() is not old:
                    continue
                new = entry[1]
                group["params"][i] = new
                state: dict[Any, Any] = optimizer.state
                if old in state:
                    state[new] = state.pop(old)
        if self.device.type == "cpu":
            return
        for param, state in optimizer.state.items():
            for key, value in state.items():
                # 0-dim "step" counters of some optimizers stay on the CPU on purpose
                moves = isinstance(value, torch.Tensor) and value.dim() > 0
                if moves and value.device != param.device:
                    state[key] = value.to(param.device)

    def _ddp(self, module: nn.Module) -> nn.parallel.DistributedDataParallel:
        opts = self.options
        devices = {p.device for p in module.parameters()}
        single_cuda = len(devices) == 1 and next(iter(devices)).type == "cuda"
        kwargs: dict[str, Any] = {}
        if opts.bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = opts.bucket_cap_mb
        if not opts.broadcast_buffers:  # newer torch renamed the flag
            kwargs[_BUFFER_SYNC_FLAG] = False
        return nn.parallel.DistributedDataParallel(
            module,
            device_ids=[next(iter(devices))] if single_cuda else None,
            find_unused_parameters=opts.find_unused_parameters,
            gradient_as_bucket_view=opts.gradient_as_bucket_view,
            static_graph=opts.static_graph,
            **kwargs,
        )

    def inputs_to_device(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.device.type == "cpu":
            return args, kwargs
        return to_device(args, self.device), to_device(kwargs, self.device)

    def _release(self, module: nn.Module) -> None:
        for sub in module.modules():
            record = _state.module_record(sub)
            if record is not None and record.owner is self:
                _state.set_module_record(sub, None)
        self.adopted.discard(module)

    def _release_modules(self) -> None:
        for parent, name, original in reversed(self._undo_batchnorm):
            setattr(parent, name, original)
        self._undo_batchnorm.clear()
        engines = False
        for module in list(self.adopted):
            record = _state.module_record(module)
            engines = engines or (record is not None and bool(record.engine))
            self._release(module)
        if engines:
            # DDP engines sit in reference cycles; free them (and the process group they hold)
            # now, before the group is destroyed, rather than at interpreter shutdown, where
            # gloo's teardown can abort the process.
            gc.collect()


def _launch_from_group(launch: _env.LaunchEnv) -> _env.LaunchEnv:
    from dataclasses import replace

    rank, world = dist.get_rank(), dist.get_world_size()
    if launch.is_distributed and (launch.rank, launch.world_size) != (rank, world):
        raise LaunchEnvironmentError(
            f"the process group already initialised says rank {rank} of {world}, the "
            f"environment says rank {launch.rank} of {launch.world_size}; make them agree."
        )
    if not launch.is_distributed:
        # no launcher variables: assume one machine, as the group's creator most likely did
        launch = replace(launch, source="process group", local_rank=rank,
                         local_world_size=world, num_nodes=1)
    return replace(launch, rank=rank, world_size=world)


def _managed_elsewhere(module: nn.Module) -> bool:
    """Modules that torch's composable APIs (replicate, fully_shard) or DataParallel manage.

    Asked once per module, when accel_ctx first meets it: a model whose root or any part is
    under a composable API keeps that engine and gets none of ours on top of it.
    """
    if isinstance(module, nn.DataParallel):
        return True
    if composable_apis(module):
        return True
    return any(type(module).__name__.startswith(p) for p in ("FSDP", "FullyShardedDataParallel"))


def composable_apis(module: nn.Module) -> list[str]:
    """Names of torch composable APIs applied to ``module`` or its parts ('replicate', ...).

    Read from torch's own registry (``torch.distributed._composable.contract._get_registry``),
    where ``replicate()`` and ``fully_shard()`` record themselves on each module they manage.
    """
    try:
        from torch.distributed._composable.contract import _get_registry
    except ImportError:  # a torch build without distributed: nothing can be applied
        return []
    names: list[str] = []
    for sub in module.modules():
        registry = _get_registry(sub)
        if registry:
            names.extend(name for name in registry if name not in names)
    return names


def _convert_batchnorm(module: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """Swap BatchNorm children for SyncBatchNorm in place; returns how to undo it."""
    undo: list[tuple[nn.Module, str, nn.Module]] = []
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.modules.batchnorm._BatchNorm) and not isinstance(
                child, nn.SyncBatchNorm
            ):
                sync = nn.SyncBatchNorm.convert_sync_batchnorm(child)  # type: ignore[no-untyped-call]
                setattr(parent, name, sync)
                undo.append((parent, name, child))
    return undo
