"""What answers at a rendezvous address: nothing, a rendezvous store, or another program.

TCPStore's client constructor can block past its own timeout when something accepts the
connection but never answers (a port held by another program), so every look here runs in a
daemon thread with a deadline of its own. Used by the rendezvous of ``distributed()`` and by
``accel-ctx launch --master`` before it hands over to torchrun; imports torch only when called.

Examples:
    >>> from accel_ctx._group.probe import is_local_address
    >>> is_local_address("127.0.0.1")
    True
"""

from __future__ import annotations

import contextlib
import errno
import socket
import threading
from datetime import timedelta
from typing import Any

NOTHING, STORE, OTHER = "nothing", "store", "other"


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


def in_thread(fn: Any, name: str) -> tuple[threading.Thread, list[Any]]:
    """Start ``fn()`` in a daemon thread (a call that can block past its own timeout); the
    list gets ``[its result]`` or ``[its exception]`` when it returns."""
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(fn())
        except Exception as exc:
            result.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread, result


def run_within(fn: Any, seconds: float) -> list[Any]:
    """``[fn()]`` or ``[exception]``; ``[]`` if it has not returned within ``seconds`` (it goes
    on in a daemon thread)."""
    thread, result = in_thread(fn, "accel_ctx-probe")
    thread.join(seconds)
    return result


def what_answers(host: str, port: int, seconds: float = 10.0) -> str:
    """``NOTHING`` (refused or unreachable), ``STORE`` (a TCPStore answers) or ``OTHER``
    (something accepts connections there but does not answer as a store within ``seconds``)."""
    if connect_error(host, port) is not None:
        return NOTHING
    from torch._C._distributed_c10d import TCPStore

    got = run_within(lambda: TCPStore(host, port, is_master=False, wait_for_workers=False,
                                      timeout=timedelta(seconds=seconds)), seconds + 1.0)
    return STORE if got and not isinstance(got[0], BaseException) else OTHER


def address_in_use(exc: BaseException) -> bool:
    """Whether ``exc`` says the port is taken (EADDRINUSE), as TCPStore's server reports it."""
    text = str(exc).lower()
    return (isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE) or (
        "eaddrinuse" in text or "address already in use" in text)
