"""The one home of accel_ctx's state.

A single ``ContextVar`` holds an immutable :class:`Stack` of frames. Entering a scope pushes a
new stack and keeps the token; leaving resets with that token. A stack counts only in the
thread and process that built it: a forked DataLoader worker or a thread that inherited the
context sees "no scope". The stack resolves the innermost runtime of each concern slot and, per
hook, the runtimes that implement it; it knows concerns only through the ``_concern`` protocol.
Per-object bookkeeping lives in weak dictionaries here, and the few process-wide things (the
rendezvous store cache, the precision runtimes visible to helper threads) too. The patch registry
in ``_patches`` is the only other process-wide state.
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from typing import Any, TypeVar

from torch import nn

from ._concern import Concern, Engine, Hooks
from ._job import SINGLE, Coordinates, Job
from ._session import Session
from ._shard import ShardPlan

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
C = TypeVar("C", bound=Concern)


@dataclass(frozen=True, slots=True)
class Frame:
    """What one scope entry contributes: the runtimes it opened (usually one)."""

    runtimes: tuple[Concern, ...]


@dataclass(frozen=True, slots=True, eq=False)
class Stack:
    """The frames active in one thread, with the innermost runtime of each concern resolved."""

    frames: tuple[Frame, ...]
    session: Session
    pid: int
    thread: int
    slots: dict[str, Concern]
    """The innermost runtime of each slot (a default only where no explicit one is open)."""
    concerns: tuple[Concern, ...]
    """The same runtimes, in order."""
    hooks: Hooks
    """Per hook, the open runtimes that implement it, in order."""
    job: Job | None = None
    """The job of the innermost ``distributed()``."""
    in_forward: bool = False
    # The same stack with ``in_forward`` set; built once per push so a top-level module call
    # only sets the ContextVar instead of allocating.
    forward: Stack | None = field(default=None, repr=False)

    def owned_here(self) -> bool:
        return self.pid == _pid and self.thread == _get_ident()

    def find(self, kind: type[C]) -> C | None:
        """The runtime of ``kind``'s slot, if one of that kind is open."""
        found = self.slots.get(kind.slot)
        return found if isinstance(found, kind) else None


_STACK: ContextVar[Stack | None] = ContextVar("accel_ctx_stack", default=None)
# Set while a patched backward runs: Tensor subclasses dispatch backward through
# __torch_function__ back to the patch, which must not scale the loss twice.
IN_BACKWARD: ContextVar[bool] = ContextVar("accel_ctx_in_backward", default=False)


def raw() -> Stack | None:
    """The stack in this context, whoever built it (hot path: one ContextVar read)."""
    return _STACK.get()


def current() -> Stack | None:
    """The stack that counts here: built by this thread in this process, else ``None``."""
    stack = _STACK.get()
    if stack is None or stack.pid != _pid or stack.thread != _get_ident():
        return None
    return stack


def coordinates() -> Coordinates:
    """Where this process stands: in the innermost ``distributed()`` job of this thread, else in
    the job the process is in (a helper thread), else rank 0 of 1."""
    stack = current()
    job = stack.job if stack is not None else None
    if job is None:
        job = process_job()
    return job.coordinates if job is not None else SINGLE


# Jobs formed in this process and still open, in any thread (outermost first). Rank and world
# are facts of the process: a thread started inside distributed() has no scope of its own, but
# its @on_main_process, main_print and state() must see the process's real coordinates.
_process_jobs: list[Job] = []


def process_job() -> Job | None:
    """The job this process is in now (the latest one still open), whichever thread formed it."""
    jobs = _process_jobs
    return jobs[-1] if jobs else None


def open_process_job(job: Job) -> None:
    with _process_lock:
        _process_jobs.append(job)


def close_process_job(job: Job) -> None:
    with _process_lock:
        if job in _process_jobs:
            _process_jobs.remove(job)


def current_job() -> Job | None:
    """The job of the innermost ``distributed()`` open here, if any."""
    stack = current()
    return stack.job if stack is not None else None


def _resolve(frames: tuple[Frame, ...]
             ) -> tuple[dict[str, Concern], tuple[Concern, ...], Hooks, Job | None]:
    slots: dict[str, Concern] = {}
    job: Job | None = None
    runtimes = [r for frame in frames for r in frame.runtimes]
    for runtime in runtimes:  # later frames are inner: they win; defaults only fill gaps
        if runtime.is_default:
            slots.setdefault(runtime.slot, runtime)
    for runtime in runtimes:
        if not runtime.is_default:
            slots[runtime.slot] = runtime
        if runtime.job is not None:
            job = runtime.job
    ordered = tuple(sorted(slots.values(), key=lambda c: c.order))
    return slots, ordered, Hooks(ordered), job


def push(frame: Frame) -> tuple[Stack, Token[Stack | None]]:
    """Push ``frame`` on this thread's stack; returns the new stack and the token to pop it."""
    ensure_fork_hook()
    below = current()
    frames = (*below.frames, frame) if below is not None else (frame,)
    session = below.session if below is not None else Session()
    slots, ordered, hooks, job = _resolve(frames)
    here = (frames, session, _pid, _get_ident(), slots, ordered, hooks, job)
    # A scope opened inside a forward (or a decorated helper it calls) stays inside it: its
    # module calls are not top-level calls.
    stack = Stack(*here, in_forward=below is not None and below.in_forward)
    object.__setattr__(stack, "forward", Stack(*here, in_forward=True))
    return stack, _STACK.set(stack)


def pop(stack: Stack, token: Token[Stack | None]) -> bool:
    """Pop ``stack``; returns False (and pops nothing) when it is not the innermost one."""
    if _STACK.get() is not stack:
        return False
    _STACK.reset(token)
    return True


# Scope exits refused because a scope entered later was still open: id(stack) -> the stack and
# what closes its entry, run once the scopes above it have closed (a `with` block's or a
# decorator's exit cannot be retried, so the stack would otherwise keep a stale frame).
_deferred_exits: dict[int, tuple[Stack, Callable[[], None]]] = {}


def defer_exit(stack: Stack, close: Callable[[], None]) -> None:
    """Run ``close`` when ``stack`` is this thread's innermost again (see ``take_deferred_exit``)."""
    with _process_lock:
        _deferred_exits[id(stack)] = (stack, close)


def take_deferred_exit() -> Callable[[], None] | None:
    """The deferred close of this thread's innermost stack, if its exit was refused before."""
    stack = current()
    if stack is None or not _deferred_exits:
        return None
    with _process_lock:
        found = _deferred_exits.get(id(stack))
        if found is None or found[0] is not stack:
            return None
        del _deferred_exits[id(stack)]
    return found[1]


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
# per-object bookkeeping
# --------------------------------------------------------------------------------------------
class ModuleRecord:
    """What a distributed runtime did to one module (kept beside it, never on it)."""

    __slots__ = ("engine", "owner", "root")

    def __init__(self, owner: object, root: bool) -> None:
        self.owner = owner
        self.root = root
        # the engine of a root (DDP, FSDP2): None until decided at its first call, then the engine,
        # or False when it needs none (nothing to train, or a single process)
        self.engine: Engine | bool | None = None


class _ModuleRecords:
    """Module -> record, beside the modules: nothing of ours in a user's module, so that
    ``torch.save(model)``, ``pickle``, ``copy.deepcopy``, ``repr`` and ``vars`` see plain torch.

    Keyed by identity with weak references (a module class may define ``__eq__``/``__hash__``);
    an entry goes with its module. A record's engine (DDP) refers to its module, so an adopted
    model stays alive while its job holds the record: the job releases them when it ends, and
    ``_adopt`` releases models nothing else refers to when a new one is adopted.
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[nn.Module], ModuleRecord]] = {}

    def get(self, module: nn.Module) -> ModuleRecord | None:
        entry = self._entries.get(id(module))
        return entry[1] if entry is not None and entry[0]() is module else None

    def set(self, module: nn.Module, record: ModuleRecord) -> None:
        key = id(module)
        entries = self._entries

        def gone(ref: weakref.ref[nn.Module]) -> None:
            entry = entries.get(key)
            if entry is not None and entry[0] is ref:
                del entries[key]

        entries[key] = (weakref.ref(module, gone), record)

    def pop(self, module: nn.Module) -> None:
        entry = self._entries.get(id(module))
        if entry is not None and entry[0]() is module:
            del self._entries[id(module)]


_module_records = _ModuleRecords()


def module_record(module: nn.Module) -> ModuleRecord | None:
    return _module_records.get(module)


def set_module_record(module: nn.Module, record: ModuleRecord | None) -> None:
    if record is None:
        _module_records.pop(module)
    else:
        _module_records.set(module, record)


class LoaderPass:
    """One ``iter(loader)`` inside a scope: what it started from and whether it ran to the end.

    A pass abandoned before its end with no backward in it (the DDP tutorial's
    ``next(iter(loader))`` peek, an evaluation cut short) is not an epoch: the loader's next
    pass takes its epoch number, and its resume position, over.
    """

    __slots__ = ("backward_start", "collectives_start", "exhausted", "metric_gathers_start",
                 "no_grad", "resume", "session", "where")

    def __init__(self, session: Session, resume: tuple[int, Any, int]) -> None:
        self.session = weakref.ref(session)  # the scopes it ran in
        self.backward_start = session.backward_calls  # the session's backward count then
        self.exhausted = False
        self.resume = resume  # (resume_skip, resume_rng, skip_batches) the pass consumed
        # for a pass sharded over several ranks (_eval_passes): the group's collectives and
        # gather_for_metrics calls at its start, and the user's line of the loop
        self.collectives_start: int | None = None
        self.metric_gathers_start = 0
        self.where = ""
        # iterated with gradients off, or the count of forwards without them at its start
        self.no_grad: bool | int = False


class LoaderRecord:
    """Per-DataLoader bookkeeping: the sharding plan of the epoch being built and positions."""

    __slots__ = (
        "__weakref__",
        "epoch",
        "epoch_plan",
        "epoch_start_rng",
        "indices",
        "last_pass",
        "plan",
        "resume_rng",
        "resume_skip",
        "skip_batches",
        "told_epochs",
        "view",
        "yielded",
    )

    def __init__(self) -> None:
        self.plan: ShardPlan | None = None  # set only while the stock iterator is being built
        self.view: object = None  # the sharding view handed to the stock iterator
        self.indices: Iterator[Any] | None = None  # the view's index iterator of this epoch
        self.epoch = 0  # epochs started inside a scope
        self.epoch_plan: ShardPlan | None = None  # the sharding plan of the current epoch
        self.yielded = 0  # batches of the current epoch handed to the user on this rank
        self.epoch_start_rng: Any = None  # RNG states just before the epoch drew its order
        self.resume_skip = 0  # global batches to skip in the next epoch (checkpoint resume)
        self.resume_rng: Any = None  # epoch-start RNG states to replay for that epoch
        self.skip_batches = 0  # skip_first_batches(): this rank's batches to skip next epoch
        self.told_epochs: dict[int, int] = {}  # id(sampler/dataset) -> epoch set_epoch() got
        self.last_pass: LoaderPass | None = None  # the latest iter() of the loader in a scope


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
_open_precisions: dict[int, Concern] = {}
# Rendezvous stores outlive a scope: a TCPStore server torn down while a peer reconnects for
# the next scope would race. Each process-group generation uses its own key prefix.
_stores: dict[tuple[str, int, int], Any] = {}
_pg_generation = 0
# Users' own GradScalers told once that they defer to a mixed_precision("fp16") scope's.
_deferring_scalers: weakref.WeakSet[Any] = weakref.WeakSet()


def first_deferral(scaler: Any) -> bool:
    """True the first time ``scaler`` (a user's GradScaler) defers to a scope's loss scaling."""
    with _process_lock:
        if scaler in _deferring_scalers:
            return False
        _deferring_scalers.add(scaler)
        return True


# log_metrics(): one writer per tracker and directory for the life of the process.
_metric_writers: dict[tuple[str, str], Any] = {}


def metric_writer(key: tuple[str, str], make: Callable[[], Any]) -> Any:
    """The writer cached under ``key`` (tracker, directory), made on first use."""
    with _process_lock:
        writer = _metric_writers.get(key)
        if writer is None:
            if not _metric_writers:
                atexit.register(close_metric_writers)
            writer = _metric_writers[key] = make()
        return writer


def close_metric_writers() -> None:
    """Close every cached writer (log_metrics flushes after each call; this frees them)."""
    with _process_lock:
        writers = list(_metric_writers.values())
        _metric_writers.clear()
    for writer in writers:
        close = getattr(writer, "close", None)
        if callable(close):
            close()


def register_precision(runtime: Concern) -> None:
    with _process_lock:
        _open_precisions[id(runtime)] = runtime


def unregister_precision(runtime: Concern) -> None:
    with _process_lock:
        _open_precisions.pop(id(runtime), None)


def open_precisions() -> list[Concern]:
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
