"""``launch(fn, nprocs)``: run a function on several local processes, from a notebook or a test.

The children are plain ``multiprocessing`` processes with the variables ``distributed()``
reads (RANK, WORLD_SIZE, ...) and a rendezvous of their own (a FileStore in a fresh temporary
folder, plus a free MASTER_PORT for code that calls ``init_process_group`` itself). The parent
watches every child: the first exception or death stops the others and is raised here.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import sys
import tempfile
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from typing import Any, Literal, TypeVar

from .._job import env as _env
from .._options import checked, positive
from ..errors import ConfigurationError
from .children import GRACE_S, child, collect, stop
from .nproc import check_process_count, local_gpus

R = TypeVar("R")


@checked
def launch(
    fn: Callable[..., R],
    nprocs: int | Literal["auto"] = "auto",
    args: tuple[Any, ...] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    start_method: Literal["fork", "spawn", "forkserver"] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    max_restarts: int = 0,
) -> R:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` new local processes; return rank 0's result.

    Each process gets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT and a private
    FileStore rendezvous, so ``with distributed():`` inside ``fn`` forms one job of
    ``nprocs`` ranks. ``nprocs="auto"`` starts one per local GPU, else 1.

    * Start method: ``fork`` on Linux while CUDA is not initialised in this process (fast;
      ``fn`` may be a lambda or a notebook function), else ``spawn`` (``fn`` and ``args``
      must pickle, and ``fn`` must be importable; a script calls launch() under
      ``if __name__ == "__main__":``). Where neither works, it says what to do.
    * An exception in any rank is raised here, the same type, with the rank in its note and
      the child's traceback as its cause; the other ranks are stopped. A rank that dies
      (signal, ``os._exit``) raises :class:`~accel_ctx.errors.DistributedError` naming it.
    * ``env`` adds variables to the children; ``timeout`` (seconds) stops a job that runs
      longer and raises DistributedError.
    * ``max_restarts=k`` (as ``accel-ctx launch --max-restarts``): when a rank fails or dies,
      every rank is stopped and the job starts again, up to ``k`` times, each time with a fresh
      rendezvous and ``TORCHELASTIC_RESTART_COUNT`` set as torchrun sets it (resume from your
      last checkpoint with ``load_state``). The error of the last attempt is raised, noting the
      restarts; KeyboardInterrupt is never retried.

    Examples:
        >>> from accel_ctx import launch
        >>> launch(pow, nprocs=2, args=(2, 10))
        1024
    """
    if not callable(fn):
        raise ConfigurationError(
            f"launch({fn!r}): give the function to run on every process, e.g. launch(train, 2).")
    world = _count(nprocs)
    if not isinstance(args, (tuple, list)):
        raise ConfigurationError(
            f"launch(args={args!r}): give the positional arguments as a tuple, e.g. args=(cfg,).")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise ConfigurationError(f"launch(kwargs={kwargs!r}): give a dict of keyword arguments.")
    if env is not None and not (isinstance(env, Mapping) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise ConfigurationError(
            f"launch(env={env!r}): give a dict of environment variables, names and values as "
            "str (e.g. env={'OMP_NUM_THREADS': '1'}).")
    if timeout is not None:
        positive("launch", "timeout", timeout, "give the seconds the job may run, or None.")
    args = tuple(args)
    kwargs = dict(kwargs or {})
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ConfigurationError(
            f"launch(max_restarts={max_restarts!r}): give the number of restarts, an int >= 0.")
    method = _start_method(fn, args, kwargs, start_method)
    for attempt in range(max_restarts + 1):
        try:
            return _run(fn, world, args, kwargs, method, env, timeout, attempt)
        except Exception as exc:
            if attempt == max_restarts:
                if max_restarts and hasattr(exc, "add_note"):
                    exc.add_note(f"launch(): the job failed {max_restarts + 1} times "
                                 f"(max_restarts={max_restarts}); this is the last failure.")
                raise
            print(f"accel-ctx launch(): attempt {attempt + 1} of {max_restarts + 1} failed "
                  f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                  f"restarting all {world} processes.", file=sys.stderr, flush=True)
    raise AssertionError("unreachable")  # the loop returns or raises


def _run(fn: Callable[..., R], world: int, args: tuple[Any, ...], kwargs: dict[str, Any],
         method: str, env: Mapping[str, str] | None, timeout: float | None, restart: int) -> R:
    """One attempt: start ``world`` children, collect rank 0's result, stop them all."""
    ctx: Any = mp.get_context(method)
    with tempfile.TemporaryDirectory(prefix="accel-ctx-launch-") as store_dir:
        base_env = {
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
            "TORCHELASTIC_RESTART_COUNT": str(restart),
            _env.INIT_METHOD_VAR: f"file://{os.path.join(store_dir, 'store')}",
            **({"OMP_NUM_THREADS": "1"} if world > 1 and "OMP_NUM_THREADS" not in os.environ
               else {}),
            **dict(env or {}),
        }
        children: list[tuple[Any, Connection]] = []
        try:
            for rank in range(world):
                reader, writer = ctx.Pipe(duplex=False)
                child_env = {**base_env, "RANK": str(rank), "LOCAL_RANK": str(rank),
                             "GROUP_RANK": "0"}
                process = ctx.Process(
                    target=child,
                    args=(fn, args, kwargs, rank, child_env, writer, os.getpid()),
                    name=f"accel-ctx-rank{rank}",
                )
                process.start()
                writer.close()  # the child holds the only writer: EOF means it is gone
                children.append((process, reader))
            result = collect(children, world, timeout)
        except BaseException:
            stop(children, wait_s=0.0)
            raise
        stop(children, wait_s=GRACE_S)  # all answered: let them finish exiting
        return result  # type: ignore[no-any-return]


def _count(nprocs: int | str) -> int:
    if nprocs == "auto":
        return local_gpus() or 1
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ConfigurationError(
            f"launch(nprocs={nprocs!r}): give a number of processes (1 or more) or 'auto'."
        )
    check_process_count(nprocs, f"launch(nprocs={nprocs})", os.environ)
    return nprocs


def _start_method(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], requested: str | None
) -> str:
    available = mp.get_all_start_methods()
    if requested is not None:
        if requested not in available:
            raise ConfigurationError(
                f"launch(start_method={requested!r}): this platform offers {available}."
            )
        method = requested
    else:
        # fork is fast and takes any function, but a forked child cannot use CUDA once the
        # parent initialised it, and macOS system libraries are not fork-safe.
        method = "fork" if sys.platform == "linux" and not _fork_unsafe() else "spawn"
    if method == "fork" and _fork_unsafe():
        raise ConfigurationError(
            f"launch(start_method='fork'): {_fork_unsafe()} in this process, and a forked "
            "child cannot use it. Use start_method='spawn', or call launch() before anything "
            "touches the GPU or forms a process group."
        )
    if method != "fork":
        _check_spawnable(fn, args, kwargs)
    return method


def _fork_unsafe() -> str:
    """Why a forked child would break, or '' (what it would inherit but cannot use)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return ""
    if torch.cuda.is_initialized():
        return "CUDA is already initialised"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return "a process group is already initialised"
    return ""


def _check_spawnable(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    why = ""
    main = sys.modules.get("__main__")
    name = getattr(fn, "__qualname__", repr(fn))
    if getattr(fn, "__module__", None) == "__main__" and not getattr(main, "__file__", None):
        why = f"{name} is defined in a notebook or interactive session, which they cannot import"
    else:
        try:
            pickle.dumps((fn, args, kwargs))
        except Exception as exc:
            why = f"{name} or its arguments cannot be pickled ({exc})"
    if why:
        reason = _fork_unsafe()
        because = f" ({reason} here, so fork cannot be used)" if reason else ""
        raise ConfigurationError(
            f"launch() must start fresh processes{because}, and {why}. Fix: put the function in a "
            ".py module and import it (arguments: plain data), or restart the kernel and call "
            "launch() before anything initialises CUDA so that fork can be used."
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


