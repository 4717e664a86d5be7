"""What torchft prints on a correct replica-group run, kept off the user's terminal while a
group's runtime is open (issue 41: a correct script prints no warning our engines cause).

Four things came with every run, none of them about the user's job:

- torchft's Manager logs "Unable to reset NCCL flight recorder recording" at each new quorum
  when torch has no NCCL flight recorder; the groups talk over gloo, where there is none to reset.
- the HTTP server that sends a healing group its state logs each request
  (``"GET /checkpoint/12/full HTTP/1.1" 200``) as Python's ``http.server`` does by default.
- torch's streaming load, which reads that state, warns once that the buffer it wraps is not
  writable (a buffer torch made and owns).
- and where DeprecationWarnings show (``python -W default``), the Manager's own call of the
  deprecated ``Logger.warn``.

Each is dropped narrowly (that logger and message, that server's successful requests, that
warning from that torch module) and only while the runtime is open; errors still show.
"""

from __future__ import annotations

import logging
import threading
import warnings
from contextlib import ExitStack
from datetime import timedelta
from typing import Any, cast

_FLIGHT_RECORDER = "Unable to reset NCCL flight recorder recording"
_READ_ONLY_BUFFER = "The given buffer is not writable"
_DEPRECATED_WARN = "The 'warn' method is deprecated"


def _no_flight_recorder_line(record: logging.LogRecord) -> bool:
    return _FLIGHT_RECORDER not in record.getMessage()


_lock = threading.Lock()
_open_runtimes = 0  # the filters are shared: the last runtime to close removes them
_removals: list[Any] = []


def quiet_torchft(exits: ExitStack) -> None:
    """Drop torchft's flight-recorder line, torch's read-only-buffer warning and the
    Manager's ``Logger.warn`` deprecation until ``exits`` closes (or, where several replica
    runtimes are open in one process, until the last of them closes)."""
    global _open_runtimes
    with _lock:
        _open_runtimes += 1
        if _open_runtimes == 1:
            manager_log = logging.getLogger("torchft.manager")
            manager_log.addFilter(_no_flight_recorder_line)
            _removals.append(lambda: manager_log.removeFilter(_no_flight_recorder_line))
            _ignore(_READ_ONLY_BUFFER, UserWarning, r"torch\.distributed\._serialization")
            _ignore(_DEPRECATED_WARN, DeprecationWarning, r"torchft\.manager")
    exits.callback(_close)


def _close() -> None:
    global _open_runtimes
    with _lock:
        _open_runtimes -= 1
        if _open_runtimes == 0:
            while _removals:
                _removals.pop()()


def _ignore(message: str, category: type[Warning], module: str) -> None:
    warnings.filterwarnings("ignore", message=message, category=category, module=module)
    entry = warnings.filters[0]  # filterwarnings puts it first

    def remove() -> None:
        filters = cast("list[Any]", warnings.filters)  # a list, typed as a Sequence
        if entry in filters:  # a user's warnings.resetwarnings() may have gone first
            filters.remove(entry)

    _removals.append(remove)


def quiet_transport(torchft: Any, timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport (the Manager's default, made the same way), its
    server not logging each request it answers; its errors are still logged."""
    transport = torchft.checkpointing.HTTPTransport(timeout=timeout, num_chunks=0)
    server: Any = getattr(transport, "_server", None)
    handler = getattr(server, "RequestHandlerClass", None)
    if handler is not None:  # torchft's layout as of 0.2; another one only logs more
        server.RequestHandlerClass = type(
            handler.__name__, (handler,), {"log_request": lambda *args, **kwargs: None})
    return transport
