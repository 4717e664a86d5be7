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

from . import _patches, _state
from ._concern import Concern
from .errors import MisnestedScopeError

P = ParamSpec("P")
R = TypeVar("R")


class _Entry:
    __slots__ = ("exits", "frame", "stack", "thread", "token")

    def __init__(self, frame: _state.Frame, exits: ExitStack) -> None:
        self.frame = frame
        self.exits = exits
        self.stack: _state.Stack | None = None
        self.token: Token[_state.Stack | None] | None = None
        self.thread = 0


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

    def _deactivate(self, entry: _Entry) -> None:
        assert entry.stack is not None and entry.token is not None
        if not _state.pop(entry.stack, entry.token):
            raise MisnestedScopeError(
                f"{type(self).__name__}() is being exited while a scope entered after it is "
                "still open (or from another thread). Exit scopes in the reverse order of "
                "entering them: nest `with` blocks instead of calling __enter__/__exit__ by hand."
            )
        entry.stack = entry.token = None

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
        entry = self._pop_entry()
        try:
            self._deactivate(entry)
        finally:
            # the teardown sees the exception (distributed() tells the other ranks about it)
            entry.exits.__exit__(exc_type, exc, tb)

    def _pop_entry(self) -> _Entry:
        thread = _state._get_ident()
        for i in range(len(self._entries) - 1, -1, -1):
            if self._entries[i].thread == thread:
                return self._entries.pop(i)
        raise MisnestedScopeError(
            f"{type(self).__name__}() was exited in a thread that did not enter it; enter and "
            "exit a scope in the same thread."
        )

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
            with entry.exits:
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
