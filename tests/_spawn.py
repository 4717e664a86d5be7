"""Run a function on W real processes (spawned, gloo on CPU) and collect what each returns.

Rendezvous goes through a FileStore in a temporary folder (no fixed ports). A child that raises
sends its traceback back; children still running at the timeout print their threads' stacks
(faulthandler, 5 s before) and are killed, so a test can fail but never hang, and says where. The timeout is scaled by tests/_timeouts.py's factor (a busy machine), and
the ranks get that factor in their environment for the timeouts they set themselves.

Ranks fork from a server that imported torch once (multiprocessing's "forkserver" with
``PRELOAD``): a rank starts in a fraction of a second instead of the ~3 s a fresh interpreter
spends importing torch, torch.distributed and torch._dynamo. The server only imports (no op
runs in it; OMP_NUM_THREADS=1 from conftest), so forking it is safe. Each rank still starts as
a spawned one would: the test's sys.path and working folder (multiprocessing sends them), the
test's current environment (sent along: a forked child would inherit the server's), the
platform's default start method for the processes it starts itself (DataLoader workers), and
accel_ctx imported afresh.
"""

from __future__ import annotations

import faulthandler
import importlib.util
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from . import _timeouts

K = TypeVar("K")
T = TypeVar("T")

STACKS_ENV = "ACCEL_CTX_TEST_STACKS_AFTER"
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch.nn.parallel",
           "torch._dynamo", "numpy.random")


def context() -> Any:
    """The shared forkserver context (one server per test session, started on first use)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


class WorkerFailed(AssertionError):
    pass


def _child(
    target: Callable[..., Any],
    rank: int,
    world: int,
    env: Mapping[str, str],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    os.environ.clear()  # the test's environment, not the forkserver's
    os.environ.update(env)
    # The platform's default start method, as in a rank torchrun starts (a fresh interpreter),
    # not the "forkserver" multiprocessing leaves as this child's default: DataLoader workers
    # fork from the rank as they would there, instead of each importing torch anew.
    mp.set_start_method(None, force=True)
    faulthandler.enable(all_threads=True)  # a rank that dies of a signal says where (SIGSEGV)
    stacks_after = float(env.get(STACKS_ENV, "0"))
    if stacks_after > 0:  # a rank still running then prints where it is, before it is killed
        faulthandler.dump_traceback_later(stacks_after, exit=False)
    try:
        import torch

        torch.set_num_threads(1)
        ours = _warnings_at_our_lines()
        value = target(*args)
        if ours:
            raise AssertionError("torch warned at accel_ctx's own calls (a user would see it; "
                                 "issue 41):\n" + "\n".join(sorted(set(ours))))
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


# torch's own warnings, raised with a stacklevel that reaches the user's `loss.backward()` line
# in plain torch and our Tensor.backward patch under the scopes (docs/troubleshooting.md):
# the same script without accel_ctx prints them too.
_TORCH_AT_USERS_BACKWARD = ("Full backward hook is firing when gradients are computed",)


def _warnings_at_our_lines() -> list[str]:
    """Every warning attributed to a line of accel_ctx, from now on, shown and listed: torch's
    answer to a call of ours (a deprecated API, an option it warns about), which a user would see
    under the scopes. accel_ctx's own warnings point at the user's line (_warn.warn_user), and a
    worker that records warnings itself (catch_warnings) keeps them."""
    spec = importlib.util.find_spec("accel_ctx")
    assert spec is not None and spec.origin is not None
    folder = os.path.dirname(spec.origin) + os.sep
    ours: list[str] = []
    shown = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: Any = None, line: str | None = None) -> None:
        if os.path.abspath(filename).startswith(folder) and not str(message).startswith(
                _TORCH_AT_USERS_BACKWARD):
            ours.append(f"{filename}:{lineno}: {category.__name__}: {message}")
        shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    warnings.filterwarnings("always", module=r"accel_ctx(\.|$)")  # past torch's and Python's ignores
    return ours


def free_port() -> int:
    """A loopback port free at this moment (for tests that need MASTER_PORT-style addresses)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(rank: int, world: int, store_dir: Path, **extra: str) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
        "ACCEL_CTX_INIT_METHOD": f"file://{store_dir / 'store'}",
        "OMP_NUM_THREADS": "1",
        **extra,
    }


def spawn(
    target: Callable[..., Any],
    world: int,
    tmp_path: Path,
    *args: Any,
    timeout: float = 120.0,
    env: Callable[[int], Mapping[str, str]] | None = None,
    expect_failure: bool = False,
) -> list[Any]:
    """Run ``target(*args)`` on ``world`` processes; return the per-rank results in rank order."""
    ctx = context()
    timeout = _timeouts.scaled(timeout)
    factor = _timeouts.child_env()
    results = ctx.Queue()
    store_dir = Path(tmp_path) / f"rdzv-{time.monotonic_ns()}"
    store_dir.mkdir(parents=True)
    procs = []
    for rank in range(world):
        extra = env(rank) if env is not None else rank_env(rank, world, store_dir)
        child_env = {**os.environ, **factor, **extra, STACKS_ENV: repr(max(1.0, timeout - 5.0))}
        p = ctx.Process(target=_child, args=(target, rank, world, child_env, args, results))
        p.start()
        procs.append(p)
    deadline = time.monotonic() + timeout
    collected: dict[int, tuple[bool, Any]] = {}
    try:
        while len(collected) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
                continue
            collected[rank] = (ok, payload)
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    failures = {r: v for r, (ok, v) in collected.items() if not ok}
    missing = [r for r in range(world) if r not in collected]
    if expect_failure:
        return [collected.get(r, (False, "no result"))[1] for r in range(world)]
    if failures or missing:
        lines = [f"rank {r} raised:\n{tb}" for r, tb in sorted(failures.items())]
        if missing:
            codes = {r: procs[r].exitcode for r in missing}
            lines.append(f"ranks {missing} sent no result (exit codes {codes}, timeout "
                         f"{timeout:.0f}s)")
        if missing or any("timed out" in tb or "Timeout" in tb for tb in failures.values()):
            lines.append(_timeouts.hint())
        raise WorkerFailed("\n".join(lines))
    return [pickle.loads(collected[r][1]) for r in range(world)]


def side_by_side(calls: Mapping[K, Callable[[], T]]) -> dict[K, T | Exception]:
    """Each call (a spawn(), usually) in a thread of its own, all at once: ranks that mostly wait
    (a timeout waited out on purpose) wait side by side. Each call's result, or the exception
    it raised, by key; :func:`outcome` gives it back or raises it, in the test that reads it."""
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        futures = {key: pool.submit(call) for key, call in calls.items()}
    done: dict[K, T | Exception] = {}
    for key, future in futures.items():
        exc = future.exception()
        if exc is None:
            done[key] = future.result()
        elif isinstance(exc, Exception):
            done[key] = exc
        else:  # KeyboardInterrupt and the like: not a test's outcome
            raise exc
    return done


def outcome(value: T | Exception) -> T:
    """A :func:`side_by_side` value: the result, or the exception raised again."""
    if isinstance(value, Exception):
        raise value
    return value
