"""What answers at a rendezvous address: nothing, a rendezvous store, or another program.

TCPStore's client constructor can block past its own timeout when something accepts the
connection but never answers (a port held by another program), so every look here runs in a
daemon thread with a deadline of its own. Used by the rendezvous of ``distributed()`` and by
``accel-ctx launch --master`` before it hands over to torchrun; imports torch only when called.

Such a thread must not return from torch's C++ while the interpreter tears down: CPython ends
a thread that takes the GIL back then (``pthread_exit``) and, inside torch's call, that aborts
the process ("terminate called without an active exception", SIGABRT) instead of letting the
user's script exit with its own error. So a call that ends by itself says when (``ends_by``),
and the interpreter's exit waits for it until then (:func:`settle`); a call that would outlast
that (blocked on a peer that never answers) is left to the process's end, where it cannot wake.

Examples:
    >>> from accel_ctx._distributed.probe import is_local_address
    >>> is_local_address("127.0.0.1")
    True
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import socket
import threading
import time
from datetime import timedelta
from typing import Any

NOTHING, STORE, OTHER = "nothing", "store", "other"
ATTEMPT_S = 2.0  # a TCPStore constructor's own timeout here: a store answers it in milliseconds
SETTLE_S = 15.0  # the longest the interpreter's exit waits for one call still under way
# Threads in a call that ends by itself, and when it has surely ended (time.monotonic()).
# No lock: one dict operation is atomic, and a lock held at a fork would hang the child's exit.
_pending: dict[threading.Thread, float] = {}
_settle_registered = [False]


def store_ends_by(seconds: float) -> float:
    """When a TCPStore constructor given ``seconds`` has surely returned: torch tries once
    more after its timeout, after a backoff delay (measured: 2.5 s for 1 s, 5.3 s for 2 s)."""
    return time.monotonic() + 2 * seconds + 5.0


def is_local_address(host: str) -> bool:
    """Whether ``host`` names an address of this machine (one a socket can be bound to)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, address in infos:
        with contextlib.suppress(OSError), socket.socket(family, kind, proto) as s:
            s.bind((address[0], 0))
            return True
    return False


def connect_error(host: str, port: int, seconds: float = 2.0) -> OSError | None:
    """None if something accepts connections at ``host:port``, else the error."""
    try:
        with socket.create_connection((host, port), timeout=seconds):
            return None
    except OSError as exc:
        return exc


def in_thread(fn: Any, name: str, ends_by: float | None = None) -> tuple[threading.Thread, list[Any]]:
    """Start ``fn()`` in a daemon thread (a call that can block past its own timeout); the
    list gets ``[its result]`` or ``[its exception]`` when it returns. ``ends_by``
    (``time.monotonic()``): when ``fn`` has surely returned by its own timeouts; the
    interpreter's exit waits for it until then (:func:`settle`).

    Examples:
        >>> thread, result = in_thread(lambda: 6 * 7, "example", ends_by=time.monotonic() + 5)
        >>> thread.join(); result
        [42]
    """
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(fn())
        except Exception as exc:
            result.append(exc)
        finally:
            _pending.pop(threading.current_thread(), None)

    thread = threading.Thread(target=run, name=name, daemon=True)
    if ends_by is not None:
        _settle_at_exit()
        _pending[thread] = ends_by
    thread.start()
    return thread, result


def settle() -> None:
    """Wait for the calls under way that end by themselves within ``SETTLE_S``, so that none
    returns from torch's C++ during the interpreter's teardown (which would abort the process).
    Runs at the interpreter's exit, before its teardown."""
    start = time.monotonic()
    for thread, ends_by in list(_pending.items()):
        if ends_by - start <= SETTLE_S:
            thread.join(max(0.0, ends_by - time.monotonic()))


def _settle_at_exit() -> None:
    if not _settle_registered[0]:
        _settle_registered[0] = True
        atexit.register(settle)


def run_within(fn: Any, seconds: float, ends_by: float | None = None) -> list[Any]:
    """``[fn()]`` or ``[exception]``; ``[]`` if it has not returned within ``seconds`` (it goes
    on in a daemon thread; ``ends_by`` as for :func:`in_thread`)."""
    thread, result = in_thread(fn, "accel_ctx-probe", ends_by)
    thread.join(seconds)
    return result


def what_answers(host: str, port: int, seconds: float = 10.0) -> str:
    """``NOTHING`` (refused or unreachable), ``STORE`` (a TCPStore answers) or ``OTHER``
    (something accepts connections there but does not answer as a store within ``seconds``)."""
    if connect_error(host, port) is not None:
        return NOTHING
    from torch._C._distributed_c10d import TCPStore

    # Something accepts there, so the constructor's timeout only bounds its retries (a store
    # answers at once; a silent program blocks it however long the timeout): a short one.
    attempt = min(seconds, ATTEMPT_S)
    got = run_within(lambda: TCPStore(host, port, is_master=False, wait_for_workers=False,
                                      timeout=timedelta(seconds=attempt)), seconds + 1.0,
                     store_ends_by(attempt))
    return STORE if got and not isinstance(got[0], BaseException) else OTHER


def address_in_use(exc: BaseException) -> bool:
    """Whether ``exc`` says the port is taken (EADDRINUSE), as TCPStore's server reports it."""
    text = str(exc).lower()
    return (isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE) or (
        "eaddrinuse" in text or "address already in use" in text)
