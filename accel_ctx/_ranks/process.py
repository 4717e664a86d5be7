"""Code that only some ranks run, and the points where all ranks meet.

The rank tests are made when the code runs, never when a function is decorated, and read the
innermost ``distributed()`` scope like :func:`~accel_ctx.state` does: outside any scope a process
is rank 0 of 1, so main-process code simply runs. So is a thread, or a DataLoader worker, that has
no scope of its own: call rank-only code from the thread that opened the scope.

What happens when rank-only code fails: an exception escaping an ``@on_main_process`` (& co.)
function, an ``on_main_process()`` (& co.) block or a ``main_process_first()`` block is
announced to the other ranks before it propagates. They do not wait for a rank that will never
come: their next ``wait_for_everyone()`` (in debug mode, their next collective) raises
:class:`~accel_ctx.errors.DistributedError` naming the failed rank, the function and the
exception, within moments. The failure is fatal to the job even if the failing rank catches the
exception and goes on (it raises at that point too): handle recoverable errors inside the
function. Code that fails under a plain ``if state().is_main_process:`` is not announced by
itself, but the exception leaving ``distributed()`` is (and a collective the others wait in
fails, naming this rank: see ``_group.blame``).

Collectives inside rank-only code: while a decorated function runs on its chosen ranks (unless
those are all the ranks), and while the first rank runs a ``main_process_first()`` block, the
code is marked rank-only; every collective entry point (``gather`` & co., ``wait_for_everyone``,
``save_state``/``load_state``/``save_model``, a backward that DDP would average) raises
:class:`~accel_ctx.errors.DistributedError` there at once, naming the decorator: the other ranks
would never join it. A forward with gradients there runs the model itself (DDP's forward
collectives would hang too). ``with on_main_process() as here:`` blocks are not marked: their
body runs on every rank.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, TypeVar, cast, overload

import wrapt
from typing_extensions import ParamSpec

from .._group import barrier as _barrier
from .._job.job import Job
from .._kernel import state as _state
from .._options import checked
from .._warn import warn_user
from ..errors import ConfigurationError

P = ParamSpec("P")
R = TypeVar("R")


def position() -> tuple[Job | None, int, int, int, int]:
    """(job, rank, world size, local rank, local world size), as state() would say."""
    job = _state.current_job()
    where = _state.coordinates()  # a helper thread of a rank sees that rank's coordinates
    return job, where.rank, where.world_size, where.local_rank, where.local_world_size


def announce(where: str, exc: BaseException) -> None:
    job, rank, world, _, _ = position()
    if job is not None and world > 1:
        failure = f"rank {rank} raised {type(exc).__name__}: {exc} {where}"
        _barrier.announce_failure(job, failure)


class ProcessFilter:
    """Runs code on the ranks it names: a decorator, or a ``with`` block that says whether to act.

    Made by :func:`on_main_process`, :func:`on_local_main_process`, :func:`on_process` and
    :func:`on_last_process`. A ``with`` block cannot skip its body in Python, so the block runs
    on every rank and ``as`` gives ``True`` on the named ranks; test it. What the block adds over
    a plain ``if``: an exception escaping it is announced to the other ranks (see the module).

    Examples:
        >>> from accel_ctx import on_main_process
        >>> with on_main_process() as here:
        ...     if here:
        ...         print("only rank 0 gets here")
        only rank 0 gets here
    """

    def __init__(self, label: str, selects: Callable[[int, int, int, int], bool],
                 rank: int | None = None, who: str = "", everyone: Callable[[int, int], bool]
                 | None = None) -> None:
        self.label = label
        self._selects = selects
        self._rank = rank  # on_process(rank): warn when the job has no such rank
        self._who = who  # "only rank 0 runs it", for errors about collectives inside
        # (world, local world) -> whether every rank is selected (then nothing is rank-only)
        self._everyone = everyone or (lambda w, lw: w == 1)

    def selected(self) -> bool:
        """Whether this process is one of the named ranks, now."""
        return self._selects(*position()[1:])

    @overload
    def __call__(
        self, fn: Callable[P, Coroutine[Any, Any, R]]
    ) -> Callable[P, Coroutine[Any, Any, R | None]]: ...
    @overload
    def __call__(self, fn: Callable[P, R]) -> Callable[P, R | None]: ...
    def __call__(self, fn: Callable[P, Any]) -> Callable[P, Any]:
        if isinstance(fn, type) or not callable(fn):
            what = f"the class {fn.__qualname__}" if isinstance(fn, type) else type(fn).__name__
            raise TypeError(
                f"{self.label} decorates functions and methods, not {what}; decorate a def."
            )
        if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            raise TypeError(
                f"{self.label} cannot decorate the generator function {fn.__qualname__}: the "
                "other ranks would get None instead of an iterator. Test "
                "`state().is_main_process` (or the like) inside it, or decorate the function "
                "that consumes it."
            )
        where = f"in {fn.__qualname__}() (run by {self.label} on that rank only)"
        warned: list[bool] = []
        rank_only = _state.RankOnly(f"{self.label} (in {fn.__qualname__}())", self._who)
        is_coroutine = inspect.iscoroutinefunction(fn)

        def run(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
            _, rank, world, local_rank, local_world = position()
            if not self._selects(rank, world, local_rank, local_world):
                if self._rank is not None and self._rank >= world and rank == 0 and not warned:
                    warned.append(True)
                    warn_user(
                        f"{fn.__qualname__}() never runs: {self.label} names rank {self._rank} "
                        f"but the job has {world} process(es). Start more processes or pick a "
                        "rank below the world size.")
                return _skipped() if is_coroutine else None
            if is_coroutine:
                return _guarded(wrapped(*args, **kwargs), where)
            mark = None
            if not self._everyone(world, local_world):  # collectives inside would hang
                mark = _state.enter_rank_only(rank_only)
            try:
                return wrapped(*args, **kwargs)
            except BaseException as exc:
                announce(where, exc)
                raise
            finally:
                if mark is not None:
                    _state.leave_rank_only(mark)

        return cast(Callable[P, Any], wrapt.FunctionWrapper(fn, run))

    def __enter__(self) -> bool:
        return self.selected()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            name = self.label.lstrip("@")
            announce(f"in an {name if name.endswith(')') else name + '()'} block", exc)


async def _skipped() -> None:
    return None


async def _guarded(coroutine: Any, where: str) -> Any:
    try:
        return await coroutine
    except BaseException as exc:
        announce(where, exc)
        raise


def _check_decorated(name: str, fn: object) -> None:
    if fn is not None and not callable(fn):
        raise TypeError(f"{name}() takes no arguments: write @{name} or @{name}().")


@overload
def on_main_process(
    fn: Callable[P, Coroutine[Any, Any, R]], /
) -> Callable[P, Coroutine[Any, Any, R | None]]: ...
@overload
def on_main_process(fn: Callable[P, R], /) -> Callable[P, R | None]: ...
@overload
def on_main_process() -> ProcessFilter: ...
@checked
def on_main_process(fn: Callable[P, R] | None = None, /) -> Callable[P, R | None] | ProcessFilter:
    """Run the function on the main process (rank 0 of the job) only; elsewhere it returns None.

    Write ``@on_main_process`` or ``@on_main_process()``; methods work too. The rank is read at
    each call. ``with on_main_process() as here:`` runs its body everywhere and gives ``here``
    (see :class:`ProcessFilter`). An exception escaping the function is announced to the other
    ranks, whose next ``wait_for_everyone()`` then raises instead of waiting forever.

    Examples:
        >>> from accel_ctx import on_main_process
        >>> @on_main_process
        ... def report(loss):
        ...     return f"loss {loss:.2f}"
        >>> report(0.5)  # one process: rank 0, so it runs
        'loss 0.50'
    """
    _check_decorated("on_main_process", fn)
    selector = ProcessFilter("@on_main_process", lambda r, w, lr, lw: r == 0,
                             who="only rank 0 runs it")
    return selector if fn is None else selector(fn)


@overload
def on_local_main_process(
    fn: Callable[P, Coroutine[Any, Any, R]], /
) -> Callable[P, Coroutine[Any, Any, R | None]]: ...
@overload
def on_local_main_process(fn: Callable[P, R], /) -> Callable[P, R | None]: ...
@overload
def on_local_main_process() -> ProcessFilter: ...
@checked
def on_local_main_process(
    fn: Callable[P, R] | None = None, /
) -> Callable[P, R | None] | ProcessFilter:
    """Run the function on the first process of each machine only; elsewhere it returns None.

    For per-machine work (a local cache, a progress bar per node). Same forms and failure
    handling as :func:`on_main_process`.

    Examples:
        >>> from accel_ctx import on_local_main_process
        >>> @on_local_main_process()
        ... def prepare_cache():
        ...     return "ready"
        >>> prepare_cache()
        'ready'
    """
    _check_decorated("on_local_main_process", fn)
    selector = ProcessFilter("@on_local_main_process", lambda r, w, lr, lw: lr == 0,
                             who="only the first process of each machine runs it",
                             everyone=lambda w, lw: lw == 1)
    return selector if fn is None else selector(fn)


@overload
def on_last_process(
    fn: Callable[P, Coroutine[Any, Any, R]], /
) -> Callable[P, Coroutine[Any, Any, R | None]]: ...
@overload
def on_last_process(fn: Callable[P, R], /) -> Callable[P, R | None]: ...
@overload
def on_last_process() -> ProcessFilter: ...
@checked
def on_last_process(fn: Callable[P, R] | None = None, /) -> Callable[P, R | None] | ProcessFilter:
    """Run the function on the last process (rank world_size - 1) only; elsewhere it returns None.

    Same forms and failure handling as :func:`on_main_process`.

    Examples:
        >>> from accel_ctx import on_last_process
        >>> @on_last_process
        ... def last():
        ...     return "last"
        >>> last()  # one process: rank 0 is also the last
        'last'
    """
    _check_decorated("on_last_process", fn)
    selector = ProcessFilter("@on_last_process", lambda r, w, lr, lw: r == w - 1,
                             who="only the last rank runs it")
    return selector if fn is None else selector(fn)


@checked
def on_process(rank: int) -> ProcessFilter:
    """Run the function on the process of the given rank only; elsewhere it returns None.

    Use as ``@on_process(1)`` or ``with on_process(1) as here:``. If the job has no such rank
    the function never runs, and rank 0 warns once. Same failure handling as
    :func:`on_main_process`.

    Examples:
        >>> from accel_ctx import on_process
        >>> @on_process(0)
        ... def first():
        ...     return "rank 0"
        >>> first()
        'rank 0'
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        hint = " (write @on_process(1), with the rank)" if callable(rank) else ""
        raise ConfigurationError(f"on_process(rank={rank!r}): give a rank >= 0{hint}.")
    return ProcessFilter(f"@on_process({rank})", lambda r, w, lr, lw: r == rank, rank,
                         who=f"only rank {rank} runs it")
