"""The one home of accel_ctx's state.

A single ``ContextVar`` holds an immutable :class:`Stack` of frames. Entering a scope pushes a
new stack and keeps the token; leaving resets with that token. A stack counts only in the
thread and process that built it: a forked DataLoader worker or a thread that inherited the
context sees "no scope". Per-object bookkeeping lives in weak dictionaries here, and the few
process-wide things (the rendezvous store cache, the precision policies visible to helper
threads) too. The patch registry in ``_patches`` is the only other process-wide state.
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from collections.abc import Callable
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ._accumulate import AccumulateRuntime, NoSyncRuntime
    from ._distributed import DistributedRuntime
    from ._precision import PrecisionRuntime

_get_ident = threading.get_ident

# --------------------------------------------------------------------------------------------
# process identity: refreshed in a forked child, so frames inherited through fork are inert
# --------------------------------------------------------------------------------------------
_pid = os.getpid()
_fork_hook_registered = False


def _after_fork_in_child() -> None:
    global _pid
    _pid = os.getpid()


def ensure_fork_hook() -> None:
    """Register the after-fork refresh once; called by the first scope, never at import."""
    global _fork_hook_registered
    if not _fork_hook_registered:
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _fork_hook_registered = True


# --------------------------------------------------------------------------------------------
# frames and stacks
# --------------------------------------------------------------------------------------------
CONCERNS = ("distributed", "precision", "accumulate", "sync")


@dataclass(frozen=True, slots=True)
class Frame:
    """What one scope entry contributes: its concern and its runtime (policy + live objects)."""

    concern: str
    runtime: Any
    scope_name: str


@dataclass(frozen=True, slots=True, eq=False)
class Stack:
    """The frames active in one thread, with the innermost runtime of each concern resolved."""

    frames: tuple[Frame, ...]
    session: Session
    pid: int
    thread: int
    dist: DistributedRuntime | None = None
    precision: PrecisionRuntime | None = None
    accumulate: AccumulateRuntime | None = None
    sync: NoSyncRuntime | None = None
    in_forward: bool = False
    # The same stack with ``in_forward`` set; built once per push so a top-level module call
    # only sets the ContextVar instead of allocating.
    forward: Stack | None = field(default=None, repr=False)

    def owned_here(self) -> bool:
        return self.pid == _pid and self.thread == _get_ident()

    def effective_precision(self) -> PrecisionRuntime | None:
        """The innermost explicit precision scope, else the launcher default of distributed()."""
        if self.precision is not None:
            return self.precision
        return self.dist.default_precision if self.dist is not None else None


_SLOTS = {"distributed": "dist", "precision": "precision", "accumulate": "accumulate", "sync": "sync"}

_STACK: ContextVar[Stack | None] = ContextVar("accel_ctx_stack", default=None)


def raw() -> Stack | None:
    """The stack in this context, whoever built it (hot path: one ContextVar read)."""
    return _STACK.get()


def current() -> Stack | None:
    """The stack that counts here: built by this thread in this process, else ``None``."""
    stack = _STACK.get()
    if stack is None or stack.pid != _pid or stack.thread != _get_ident():
        return None
    return stack


def _build(frames: tuple[Frame, ...], session: Session, in_forward: bool = False) -> Stack:
    slots: dict[str, Any] = {}
    for frame in frames:  # later frames are inner: they win
        slots[_SLOTS[frame.concern]] = frame.runtime
    return Stack(frames, session, _pid, _get_ident(), in_forward=in_forward, **slots)


def push(frame: Frame) -> tuple[Stack, Token[Stack | None]]:
    """Push ``frame`` on this thread's stack; returns the new stack and the token to pop it."""
    ensure_fork_hook()
    below = current()
    frames = (*below.frames, frame) if below is not None else (frame,)
    session = below.session if below is not None else Session()
    # A scope opened inside a forward (or a decorated helper it calls) stays inside it: its
    # module calls are not top-level calls.
    stack = _build(frames, session, in_forward=below is not None and below.in_forward)
    object.__setattr__(stack, "forward", _build(frames, session, in_forward=True))
    return stack, _STACK.set(stack)


def pop(stack: Stack, token: Token[Stack | None]) -> bool:
    """Pop ``stack``; returns False (and pops nothing) when it is not the innermost one."""
    if _STACK.get() is not stack:
        return False
    _STACK.reset(token)
    return True


def enter_forward(stack: Stack) -> Token[Stack | None]:
    assert stack.forward is not None
    return _STACK.set(stack.forward)


def reset(token: Token[Stack | None]) -> None:
    _STACK.reset(token)


# What runs on some ranks only, now (``@on_main_process`` & co., the first rank's turn in
# ``main_process_first()``): a description such as "@on_main_process (in report())", set while
# it runs on the chosen ranks, read by every collective entry point (one ContextVar read).
_RANK_ONLY: ContextVar[RankOnly | None] = ContextVar("accel_ctx_rank_only", default=None)


@dataclass(frozen=True, slots=True)
class RankOnly:
    """Code running on some ranks only: who it is and which ranks run it."""

    label: str
    """"@on_main_process (in report())", "main_process_first()"."""
    who: str
    """"only rank 0 runs it"."""


def rank_only() -> RankOnly | None:
    """The rank-only code running in this context, if any."""
    return _RANK_ONLY.get()


def enter_rank_only(mark: RankOnly) -> Token[RankOnly | None]:
    return _RANK_ONLY.set(mark)


def leave_rank_only(token: Token[RankOnly | None]) -> None:
    _RANK_ONLY.reset(token)


# --------------------------------------------------------------------------------------------
# the session: mutable bookkeeping shared by the nested scopes of one outermost entry
# --------------------------------------------------------------------------------------------
class OptimizerRecord:
    """Per-optimizer counters: calls of ``step()``, real steps, and re-entrancy depth."""

    __slots__ = ("__weakref__", "calls", "depth", "depth_mark", "last_group", "real", "skipping")

    def __init__(self) -> None:
        self.calls = 0  # step() calls seen in a scope
        self.real = 0  # of those, steps that really updated the parameters
        self.depth = 0  # >1 while a subclass's step() calls super().step()
        self.depth_mark = -1  # backward count when the outer step() began
        self.last_group = -1  # accumulation group of the last allowed step
        self.skipping = False


class LoaderIteration:
    """One epoch of one DataLoader being iterated in this thread."""

    __slots__ = ("index", "is_last", "is_padding", "length", "loader", "uneven")

    def __init__(self, length: int | None, uneven: Any = None) -> None:
        self.length = length
        self.index = -1  # index of the batch handed out last
        self.is_last = False
        self.is_padding = False  # that batch repeats earlier samples to even out the ranks
        self.loader: Any = None  # the DataLoader being iterated (the stock iterator drops it)
        self.uneven = uneven  # even_batches=False: the _join.UnevenTail of this epoch


class Session:
    """Counters of one outermost scope entry in one thread (steps, backward passes, loaders)."""

    def __init__(self) -> None:
        self.backward_calls = 0
        self.step = 0  # optimizer steps taken (skipped fp16 steps included)
        self.skipped_steps = 0
        self.last_counted_group = -1
        self.optimizers: weakref.WeakKeyDictionary[torch.optim.Optimizer, OptimizerRecord] = (
            weakref.WeakKeyDictionary()
        )
        self.schedulers: weakref.WeakKeyDictionary[Any, tuple[int, int]] = (
            weakref.WeakKeyDictionary()
        )
        self.loaders: list[LoaderIteration] = []
        # DataLoaders in the order of their first iteration in this session, and what runs at
        # each first iteration (a checkpoint's positions for loaders it knows by that order).
        self.loader_order: list[weakref.ref[Any]] = []
        self.loader_hooks: list[Callable[[Any, LoaderRecord], None]] = []

    def first_iteration(self, loader: Any, record: LoaderRecord) -> None:
        """Note ``loader`` when it is iterated for the first time in this session."""
        if any(ref() is loader for ref in self.loader_order):
            return
        self.loader_order.append(weakref.ref(loader))
        for hook in list(self.loader_hooks):
            hook(loader, record)

    def optimizer(self, optimizer: torch.optim.Optimizer) -> OptimizerRecord:
        record = self.optimizers.get(optimizer)
        if record is None:
            record = self.optimizers[optimizer] = OptimizerRecord()
        return record

    def active_loader(self) -> LoaderIteration | None:
        """The loader that handed out a batch most recently started (an inner loop's)."""
        return self.loaders[-1] if self.loaders else None

    def driving_loader(self) -> LoaderIteration | None:
        """The outermost loader being iterated: it ends accumulation groups (not a side stream
        or an evaluation loop inside the training loop)."""
        return self.loaders[0] if self.loaders else None


# --------------------------------------------------------------------------------------------
# per-object bookkeeping
# --------------------------------------------------------------------------------------------
MODULE_KEY = "_accel_ctx"


class ModuleRecord:
    """What a distributed runtime did to one module; kept in ``module.__dict__[MODULE_KEY]``.

    Stored on the module (not in a table) because the DDP engine references the module: a
    table entry would keep a dropped model alive until the scope ends. Copies and pickles of
    the module get an inert empty dict instead of the live engine.
    """

    __slots__ = ("engine", "owner", "root")

    def __init__(self, owner: object, root: bool) -> None:
        self.owner = owner
        self.root = root
        # the DDP engine of a root: None until its first call with gradients, then the engine,
        # or False when it needs none (nothing to train, or a single process)
        self.engine: Any = None

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[str, Any]:
        return {}

    def __reduce__(self) -> tuple[type[dict[str, Any]], tuple[()]]:
        return (dict, ())


def module_record(module: torch.nn.Module) -> ModuleRecord | None:
    record = module.__dict__.get(MODULE_KEY)
    return record if isinstance(record, ModuleRecord) else None


def set_module_record(module: torch.nn.Module, record: ModuleRecord | None) -> None:
    if record is None:
        module.__dict__.pop(MODULE_KEY, None)
    else:
        module.__dict__[MODULE_KEY] = record


class LoaderRecord:
    """Per-DataLoader bookkeeping: the sharding plan of the epoch being built and positions."""

    __slots__ = (
        "__weakref__",
        "epoch",
        "epoch_plan",
        "epoch_start_rng",
        "indices",
        "plan",
        "resume_rng",
        "resume_skip",
        "view",
        "yielded",
    )

    def __init__(self) -> None:
        self.plan: Any = None  # set only while the stock iterator is being built in a scope
        self.view: Any = None  # the sharding view handed to the stock iterator
        self.indices: Any = None  # the view's index iterator of the current epoch
        self.epoch = 0  # epochs started inside a scope
        self.epoch_plan: Any = None  # the sharding plan of the current epoch
        self.yielded = 0  # batches of the current epoch handed to the user on this rank
        self.epoch_start_rng: Any = None  # RNG states just before the epoch drew its order
        self.resume_skip = 0  # global batches to skip in the next epoch (checkpoint resume)
        self.resume_rng: Any = None  # epoch-start RNG states to replay for that epoch


_loader_records: weakref.WeakKeyDictionary[Any, LoaderRecord] = weakref.WeakKeyDictionary()


def loader_record(loader: Any) -> LoaderRecord:
    record = _loader_records.get(loader)
    if record is None:
        record = _loader_records[loader] = LoaderRecord()
    return record


def peek_loader_record(loader: Any) -> LoaderRecord | None:
    return _loader_records.get(loader)


# --------------------------------------------------------------------------------------------
# process-wide resources
# --------------------------------------------------------------------------------------------
_process_lock = threading.Lock()
# Precision runtimes open in any thread of this process, for @autocast_forward in helper threads.
_open_precisions: dict[int, PrecisionRuntime] = {}
# Rendezvous stores outlive a scope: a TCPStore server torn down while a peer reconnects for
# the next scope would race. Each process-group generation uses its own key prefix.
_stores: dict[tuple[str, int, int], Any] = {}
_pg_generation = 0


def register_precision(runtime: PrecisionRuntime) -> None:
    with _process_lock:
        _open_precisions[id(runtime)] = runtime


def unregister_precision(runtime: PrecisionRuntime) -> None:
    with _process_lock:
        _open_precisions.pop(id(runtime), None)


def open_precisions() -> list[PrecisionRuntime]:
    with _process_lock:
        return list(_open_precisions.values())


def cached_store(key: tuple[str, int, int]) -> Any | None:
    with _process_lock:
        return _stores.get(key)


def cache_store(key: tuple[str, int, int], store: Any) -> None:
    with _process_lock:
        if not _stores:  # close them before interpreter teardown, not during it
            atexit.register(_close_stores)
        _stores[key] = store


def _close_stores() -> None:
    with _process_lock:
        _stores.clear()


def next_pg_generation() -> int:
    global _pg_generation
    with _process_lock:
        _pg_generation += 1
        return _pg_generation


# --------------------------------------------------------------------------------------------
# the public snapshot
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class State:
    """A read-only snapshot of where this process stands, taken by :func:`state`."""

    rank: int = 0
    """This process's index in the job (0 outside ``distributed()``)."""
    world_size: int = 1
    """Processes in the job."""
    local_rank: int = 0
    """Index among the processes on this machine."""
    local_world_size: int = 1
    """Processes on this machine."""
    node_rank: int = 0
    """Index of this machine."""
    num_nodes: int = 1
    """Machines in the job."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where ``distributed()`` puts modules and batches."""
    backend: str | None = None
    """The process group's backend (None for one process)."""
    distributed: bool = False
    """Inside a ``distributed()`` scope."""
    mixed_precision: str = "no"
    """The active precision policy: 'bf16', 'fp16' or 'no'."""
    loss_scale: float | None = None
    """fp16: the current loss scale (updated before the next backward)."""
    skipped_steps: int = 0
    """fp16: optimizer steps skipped because of inf/NaN gradients."""
    accumulation_steps: int = 1
    """Micro-batches per optimizer step."""
    sync_gradients: bool = True
    """Whether the last backward closed an accumulation group (a real optimizer step follows)."""
    step: int = 0
    """Optimizer steps taken in this scope (once per accumulation group, skipped ones included)."""

    @property
    def is_main_process(self) -> bool:
        """Rank 0 of the job."""
        return self.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        """The first process on this machine."""
        return self.local_rank == 0

    @property
    def is_last_process(self) -> bool:
        """The highest rank of the job."""
        return self.rank == self.world_size - 1


def state() -> State:
    """Where this process stands: rank, world size, device and the active settings.

    Read when called, so it follows the scopes: outside any scope it answers for a single
    process (rank 0 of 1, on the CPU).

    Example:
        >>> from accel_ctx import distributed, state
        >>> state().world_size
        1
        >>> with distributed():
        ...     s = state()
        >>> s.rank, s.is_main_process
        (0, True)
    """
    stack = current()
    if stack is None:
        return State()
    values: dict[str, Any] = {"step": stack.session.step, "skipped_steps": stack.session.skipped_steps}
    runtime = stack.dist
    if runtime is not None:
        launch = runtime.launch
        values.update(
            rank=launch.rank,
            world_size=launch.world_size,
            local_rank=launch.local_rank,
            local_world_size=launch.local_world_size,
            node_rank=launch.node_rank,
            num_nodes=launch.num_nodes,
            device=runtime.device,
            backend=runtime.backend,
            distributed=True,
        )
    precision = stack.effective_precision()
    if precision is not None:
        values.update(mixed_precision=precision.policy.name, loss_scale=precision.loss_scale())
    accumulation = stack.accumulate
    if accumulation is not None:
        values.update(
            accumulation_steps=accumulation.steps, sync_gradients=accumulation.sync_gradients
        )
    return State(**values)
