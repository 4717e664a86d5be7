"""The one home of accel_ctx's state.

A single ``ContextVar`` holds an immutable :class:`Stack` of frames. Entering a scope pushes a
new stack and keeps the token; leaving resets with that token. A stack counts only in the
thread and process that built it: a forked DataLoader worker or a thread that inherited the
context sees "no scope". The stack resolves the innermost runtime of each concern slot and, per
hook, the runtimes that implement it; it knows concerns only through the ``_kernel.concern`` protocol.
Records and caches live with their owners (a loader's in ``_data.iterate.records``, a module's in
``_engines.records``, the rendezvous stores in ``_group.group``, ...), each registering its
own reset for a forked child here (:func:`reset_after_fork`) and its own close before the
interpreter's teardown (:func:`close_at_exit`). The patch registry in ``_hooks.patches`` is the
only other process-wide state.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Callable
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .._job.coordinates import SINGLE, Coordinates
from .._job.job import Job, process_job
from .concern import Concern, Hooks
from .session import Session

_get_ident = threading.get_ident

# --------------------------------------------------------------------------------------------
# process identity: refreshed in a forked child, so frames inherited through fork are inert
# --------------------------------------------------------------------------------------------
_pid = os.getpid()
_fork_hook_registered = False


_fork_resets: list[Callable[[], None]] = []
_process_lock = threading.Lock()


def reset_after_fork(reset: Callable[[], None]) -> Callable[[], None]:
    """Run ``reset`` in a forked child (a DataLoader worker, ``launch()``'s ranks): each owner of
    a process-wide cache registers its own, in one line (appending: nothing happens at import)."""
    _fork_resets.append(reset)
    return reset


_left_to_the_parent: list[Any] = []


def leave_to_the_parent(objects: Any) -> None:
    """In a forked child: keep the parent's objects (stores, writers) referenced for good, so
    that no destructor of theirs runs here (it would act on the parent's files)."""
    _left_to_the_parent.append(objects)


def _after_fork_in_child() -> None:
    global _pid, _process_lock
    _pid = os.getpid()
    _process_lock = threading.Lock()  # the parent's may have been held by a thread that is gone
    _deferred_exits.clear()
    for reset in _fork_resets:
        reset()


_exit_hooks: set[Callable[[], None]] = set()


def close_at_exit(close: Callable[[], None]) -> None:
    """Run ``close`` before the interpreter's teardown (once, however often it is asked)."""
    with _process_lock:
        if close not in _exit_hooks:
            _exit_hooks.add(close)
            atexit.register(close)


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

    def find(self, kind: type[C]) -> C | None:
        """The runtime of ``kind``'s slot, if one of that kind is open."""
        found = self.slots.get(kind.slot)
        return found if isinstance(found, kind) else None


_STACK: ContextVar[Stack | None] = ContextVar("accel_ctx_stack", default=None)
# Set while a patched backward runs: Tensor subclasses dispatch backward through
# __torch_function__ back to the patch, which must not scale the loss twice.
IN_BACKWARD: ContextVar[bool] = ContextVar("accel_ctx_in_backward", default=False)


read_stack = _STACK.get
"""The stack in this context (one object for the life of the process: ``_hooks.tracing`` tells
Dynamo how to trace this very read in the patched ``nn.Module.__call__``)."""


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


# A top-level module call enters its stack's ``forward`` twin and resets to the token after; the
# hot path (once per training step) calls these bound methods directly, no function around them.
set_stack = _STACK.set
reset_stack = _STACK.reset


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


rank_only = _RANK_ONLY.get
"""The rank-only code running in this context, if any (the ContextVar's own read: a forward
and a backward ask every step)."""


def enter_rank_only(mark: RankOnly) -> Token[RankOnly | None]:
    return _RANK_ONLY.set(mark)


def leave_rank_only(token: Token[RankOnly | None]) -> None:
    _RANK_ONLY.reset(token)
