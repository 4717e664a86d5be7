"""``launch()``'s children: what each runs, and how the parent collects them.

Each child runs the function with the launch variables in its environment and sends back one
message (rank 0's value, or the exception with its traceback); a child whose caller died stops
itself. The parent waits for every message, stops the others at the first failure (SIGTERM,
then SIGKILL after a grace period) and re-raises it naming the rank.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from typing_extensions import override

from ..errors import DistributedError

GRACE_S = 3.0  # how long stopped children get to exit on SIGTERM before SIGKILL


class _RemoteTraceback(Exception):
    """Carries a child's formatted traceback as the ``__cause__`` of the re-raised error."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    @override
    def __str__(self) -> str:
        return self.text


def child(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    rank: int,
    env: dict[str, str],
    conn: Connection,
    parent: int,
) -> None:
    os.environ.update(env)
    watched = (parent, os.getppid())  # forkserver's children have the server as parent
    threading.Thread(target=_orphan_watch, args=(watched,), daemon=True).start()
    if "OMP_NUM_THREADS" in env and "torch" in sys.modules:  # torch read the variable already
        sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))
    message: tuple[Any, ...]
    result: Any = None
    try:
        result = fn(*args, **kwargs)
        message = ("ok",)
    except SystemExit as exc:  # raised in the caller it would end the caller: report it
        if exc.code in (None, 0):
            message = ("ok",)
        else:
            message = ("error", b"", traceback.format_exc(), f"raised SystemExit({exc.code!r})")
    except BaseException as exc:  # everything else goes to the parent as it is
        text = traceback.format_exc()
        try:
            payload = pickle.dumps(exc)
            pickle.loads(payload)  # some exceptions pickle but cannot be rebuilt
        except Exception:
            payload = b""
        message = ("error", payload, text, f"raised {type(exc).__name__}: {exc}")
    if message[0] == "ok":  # only rank 0's value travels: other ranks may return anything
        try:
            message = ("ok", pickle.dumps(result) if rank == 0 else b"")
        except Exception as exc:
            message = ("error", b"", traceback.format_exc(),
                       f"returned a value that cannot be sent back ({exc}); return plain "
                       "data (numbers, tensors, dicts) or save the result to a file")
    conn.send(message)
    conn.close()


def _orphan_watch(parents: tuple[int, int]) -> None:
    # A child whose caller died (a killed notebook kernel) must not wait forever on its peers.
    while os.getppid() in parents:
        time.sleep(1.0)
    os._exit(1)


def collect(children: list[tuple[Any, Connection]], world: int, timeout: float | None) -> Any:
    deadline = None if timeout is None else time.monotonic() + timeout
    pending = set(range(world))
    result: Any = None
    while pending:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise DistributedError(
                f"launch(): the job of {world} processes ran past timeout={timeout} s and was "
                "stopped; raise the timeout, or look for a rank waiting on a collective the "
                "others never reach."
            )
        # Wake up at least twice a second to look for exited children: the pipe of a dead
        # child (and its multiprocessing sentinel) stays open while helpers it forked, such
        # as DataLoader workers, live on; only its exit code tells at once.
        wait([children[r][1] for r in pending], timeout=min(0.5, left or 0.5))
        for rank in sorted(pending):
            process, reader = children[rank]
            if not reader.poll() and process.exitcode is None:
                continue  # still working
            pending.discard(rank)
            try:
                if not reader.poll():  # exited, and nothing was sent
                    raise EOFError
                message = reader.recv()
            except EOFError:
                process.join(5.0)
                raise DistributedError(
                    f"launch(): rank {rank} of {world} died ({_exit_reason(process.exitcode)}) "
                    "before returning; the other ranks were stopped. A crash in native code or "
                    "running out of memory does this; its output is above."
                ) from None
            if message[0] == "error":
                _raise_remote(rank, world, *message[1:])
            if rank == 0:
                result = pickle.loads(message[1])
    return result


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _raise_remote(rank: int, world: int, payload: bytes, text: str, summary: str) -> None:
    cause = _RemoteTraceback(f"\n\nrank {rank} of {world}:\n{text}")
    if payload:
        exc = pickle.loads(payload)
        if isinstance(exc, BaseException):
            note = f"raised by rank {rank} of {world} in launch(); the other ranks were stopped"
            culprit = getattr(exc, "culprit", None)  # the rank our DistributedError blames
            if isinstance(culprit, int) and culprit != rank:
                note = (f"launch(): rank {culprit} of {world} caused this failure (named by rank "
                        f"{rank}, which raised it); the other ranks were stopped")
            if hasattr(exc, "add_note"):
                exc.add_note(note)
            raise exc from cause
    raise DistributedError(f"launch(): rank {rank} of {world} {summary}") from cause


def stop(children: list[tuple[Any, Connection]], wait_s: float) -> None:
    """Every child is gone on return: ``wait_s`` to exit, then SIGTERM, then SIGKILL."""
    deadline = time.monotonic() + wait_s
    for process, reader in children:
        reader.close()
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + GRACE_S
    for process, _ in children:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()
