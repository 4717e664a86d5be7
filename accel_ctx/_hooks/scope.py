"""The base of every scope: a context manager that is also a decorator.

Each entry is fresh: a decorated call runs in a clone of the scope, and everything needed to
undo an entry lives in that entry's ``ExitStack``, not on the scope object (the slip of keeping
restore data on ``self`` that ``torch.autocast`` makes). A decorated generator keeps one entry
for its whole life and activates its frame only while it runs, so a suspended generator never
leaks its scope into the caller.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable, Coroutine, Generator
from contextlib import ExitStack
from contextvars import Token
from types import TracebackType
from typing import Any, TypeVar, cast

import wrapt
from typing_extensions import ParamSpec, Self

from .._kernel import state as _state
from .._kernel.concern import Concern
from ..errors import MisnestedScopeError
from . import patches as _patches

P = ParamSpec("P")
R = TypeVar("R")


class _Entry:
    __slots__ = ("closed", "deferred", "exits", "frame", "stack", "thread", "token")

    def __init__(self, frame: _state.Frame, exits: ExitStack) -> None:
        self.frame = frame
        self.exits = exits
        self.stack: _state.Stack | None = None
        self.token: Token[_state.Stack | None] | None = None
        self.thread = 0
        # its exit was refused (a scope entered after it was still open): it closes as soon as
        # those scopes close, and then ``closed`` makes a retried exit a no-op
        self.deferred = False
        self.closed = False


_ExcInfo = tuple[type[BaseException] | None, BaseException | None, TracebackType | None]


def _close_deferred() -> None:
    """Close the entries whose exits were refused, innermost first, once they are innermost."""
    close = _state.take_deferred_exit()
    if close is not None:
        try:
            close()
        finally:
            _close_deferred()


class _Closing:
    """``with entry.exits`` for a decorated generator's entry, unless its exit was refused
    (a scope it left open is still open): the entry then closes when that scope does."""

    def __init__(self, entry: _Entry) -> None:
        self.entry = entry

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool | None:
        if self.entry.deferred:
            return None
        try:
            return self.entry.exits.__exit__(exc_type, exc, tb)
        finally:
            _close_deferred()


class Scope:
    """Context manager and decorator; subclasses say what one entry sets up and tears down."""

    def __init__(self) -> None:
        self._entries: list[_Entry] = []

    # ---- what a subclass provides ---------------------------------------------------------
    def _open(self, exits: ExitStack) -> Concern | tuple[Concern, ...]:
        """Set up one entry; register every undo on ``exits``; return the runtime(s) it opens."""
        raise NotImplementedError

    # ---- entering and leaving ---------------------------------------------------------------
    def _begin(self) -> _Entry:
        exits = ExitStack()
        try:
            _patches.acquire()
            exits.callback(_patches.release)
            runtime = self._open(exits)
        except BaseException:
            exits.close()
            raise
        runtimes = runtime if isinstance(runtime, tuple) else (runtime,)
        return _Entry(_state.Frame(runtimes), exits)

    def _activate(self, entry: _Entry) -> None:
        entry.stack, entry.token = _state.push(entry.frame)
        entry.thread = entry.stack.thread

    def _deactivate(self, entry: _Entry, exc_info: _ExcInfo = (None, None, None)) -> None:
        """Pop ``entry``'s frame; when a scope entered after it is still open, refuse: the
        entry stays open and closes (with ``exc_info``) as soon as the scopes above it do."""
        stack, token = entry.stack, entry.token
        assert stack is not None and token is not None
        if not _state.pop(stack, token):
            if not entry.deferred:
                entry.deferred = True
                _state.defer_exit(stack, functools.partial(self._close_later, entry, exc_info))
            raise MisnestedScopeError(
                f"{type(self).__name__}() is being exited while a scope entered after it is "
                "still open; it stays open and closes as soon as the scopes entered after it "
                "are exited. Exit scopes in the reverse order of entering them: nest `with` "
                "blocks instead of calling __enter__/__exit__ by hand."
            )
        entry.stack = entry.token = None

    def _close_later(self, entry: _Entry, exc_info: _ExcInfo) -> None:
        """Close an entry whose exit was refused, now that it is innermost again."""
        assert entry.stack is not None and entry.token is not None
        _state.pop(entry.stack, entry.token)
        entry.stack = entry.token = None
        entry.deferred, entry.closed = False, True
        entry.exits.__exit__(*exc_info)

    def __enter__(self) -> Self:
        entry = self._begin()
        try:
            self._activate(entry)
        except BaseException:
            entry.exits.close()
            raise
        self._entries.append(entry)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        entry = self._exiting_entry()
        if entry.closed:  # its refused exit took effect when the scopes above it closed
            self._entries.remove(entry)
            return
        self._deactivate(entry, (exc_type, exc, tb))  # refused: the entry stays
        self._entries.remove(entry)
        try:
            # the teardown sees the exception (distributed() tells the other ranks about it)
            entry.exits.__exit__(exc_type, exc, tb)
        finally:
            _close_deferred()

    def _exiting_entry(self) -> _Entry:
        """This thread's innermost open entry; else one whose exit was refused before."""
        thread = _state._get_ident()
        mine = [e for e in self._entries if e.thread == thread]
        for entry in reversed(mine):
            if not (entry.deferred or entry.closed):
                return entry
        if mine:
            return mine[-1]
        where = "in a thread that did not enter it; enter and exit a scope in the same thread" \
            if self._entries else "more often than it was entered"
        raise MisnestedScopeError(f"{type(self).__name__}() was exited {where}.")

    # ---- decorating ---------------------------------------------------------------------------
    def _clone(self) -> Self:
        clone = copy.copy(self)
        clone._entries = []
        return clone

    def __call__(self, fn: Callable[P, R]) -> Callable[P, R]:
        if isinstance(fn, type):
            raise TypeError(
                f"{type(self).__name__}() decorates functions and methods, not the class "
                f"{fn.__qualname__}; decorate its methods (for example forward) instead."
            )
        if not callable(fn):
            raise TypeError(
                f"{type(self).__name__}() can decorate a function, got {type(fn).__name__}; "
                f"use `@{type(self).__name__.lower()}(...)` on a def."
            )
        if inspect.isgeneratorfunction(fn):
            return cast(Callable[P, R], self._wrap_generator(fn))
        if inspect.iscoroutinefunction(fn):
            return cast(Callable[P, R], self._wrap_coroutine(fn))
        if inspect.isasyncgenfunction(fn):
            raise TypeError(
                f"{type(self).__name__}() cannot decorate the async generator "
                f"{fn.__qualname__}; open the scope with `with` inside it instead."
            )

        def run(wrapped: Callable[..., R], instance: Any, args: Any, kwargs: Any) -> R:
            with self._clone():
                return wrapped(*args, **kwargs)

        return cast(Callable[P, R], wrapt.FunctionWrapper(fn, run))

    def _wrap_coroutine(
        self, fn: Callable[..., Coroutine[Any, Any, Any]]
    ) -> Callable[..., Coroutine[Any, Any, Any]]:
        @functools.wraps(fn)
        async def run(*args: Any, **kwargs: Any) -> Any:
            with self._clone():
                return await fn(*args, **kwargs)

        return run

    def _wrap_generator(
        self, fn: Callable[..., Generator[Any, Any, Any]]
    ) -> Callable[..., Generator[Any, Any, Any]]:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
            scope = self._clone()
            entry = scope._begin()
            with _Closing(entry):
                gen = fn(*args, **kwargs)
                sent: Any = None
                thrown: BaseException | None = None
                while True:
                    scope._activate(entry)
                    try:
                        value = gen.throw(thrown) if thrown is not None else gen.send(sent)
                    except StopIteration as stop:
                        return stop.value
                    finally:
                        scope._deactivate(entry)
                    _close_deferred()  # scopes whose exit the generator's frame held back
                    thrown = None
                    try:
                        sent = yield value
                    except GeneratorExit:
                        scope._activate(entry)
                        try:
                            gen.close()
                        finally:
                            scope._deactivate(entry)
                        raise
                    except BaseException as exc:
                        thrown = exc

        return run
