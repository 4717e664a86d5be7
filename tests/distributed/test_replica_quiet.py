"""What a replica group keeps off the terminal (torchft's noise on a correct run) is dropped
narrowly and only while the group's runtime is open: the user's own warnings and log lines with
the same words still show, and after the runtime closes nothing of it is left behind. The
launched runs (test_replica_groups.py) check that a healing job prints none of it."""

from __future__ import annotations

import logging
import warnings
from contextlib import ExitStack
from datetime import timedelta
from http.server import BaseHTTPRequestHandler

import pytest

from accel_ctx._engines import replica_quiet

BUFFER = "The given buffer is not writable, and PyTorch does not support non-writable tensors."


def _shown(message: str, category: type[Warning], module: str) -> bool:
    with warnings.catch_warnings(record=True) as caught:
        # the entries that name a module (the runtime's), then every other warning shown
        warnings.filters[:] = [entry for entry in warnings.filters if entry[3] is not None]
        warnings.filterwarnings("always", append=True)
        warnings.warn_explicit(message, category, f"{module.replace('.', '/')}.py", 63,
                               module=module)
    return bool(caught)


def _logged(logger: logging.Logger, text: str) -> bool:
    return bool(logger.filter(logger.makeRecord(logger.name, logging.WARNING, __file__, 1, text,
                                                None, None)))


def test_torchfts_noise_is_dropped_while_open_and_nothing_is_left_after() -> None:
    filters_before = list(warnings.filters)
    manager_log = logging.getLogger("torchft.manager")
    filters_of_the_logger = list(manager_log.filters)
    line = "[accel_ctx_0:abc/0 - step 5] Unable to reset NCCL flight recorder recording so ..."
    with ExitStack() as exits:
        replica_quiet.quiet_torchft(exits)
        assert not _shown(BUFFER, UserWarning, "torch.distributed._serialization")
        assert not _shown("The 'warn' method is deprecated, use 'warning' instead",
                          DeprecationWarning, "torchft.manager")
        assert not _logged(manager_log, line)
        # the same words elsewhere, and torchft's other lines, still come through
        assert _shown(BUFFER, UserWarning, "train")
        assert _shown("The 'warn' method is deprecated", DeprecationWarning, "train")
        assert _logged(manager_log, "[accel_ctx_0:abc/0 - step 5] got exception in pg configure")
        assert _logged(logging.getLogger("train"), line)
    assert warnings.filters == filters_before
    assert manager_log.filters == filters_of_the_logger
    assert _shown(BUFFER, UserWarning, "torch.distributed._serialization")
    assert _logged(manager_log, line)


def test_two_runtimes_open_at_once_keep_the_noise_off_until_the_last_one_closes() -> None:
    filters_before = list(warnings.filters)
    manager_log = logging.getLogger("torchft.manager")
    line = "[accel_ctx_1:abc/0 - step 2] Unable to reset NCCL flight recorder recording so ..."
    first, second = ExitStack(), ExitStack()
    replica_quiet.quiet_torchft(first)
    replica_quiet.quiet_torchft(second)
    first.close()  # the other runtime is still open: its noise is still dropped
    assert not _shown(BUFFER, UserWarning, "torch.distributed._serialization")
    assert not _logged(manager_log, line)
    second.close()
    assert warnings.filters == filters_before
    assert _shown(BUFFER, UserWarning, "torch.distributed._serialization")
    assert _logged(manager_log, line)


def test_the_transport_answers_without_a_line_per_request_and_still_logs_errors() -> None:
    torchft = pytest.importorskip("torchft", reason="replica groups need torchft")
    transport = replica_quiet.quiet_transport(torchft, timedelta(seconds=5))
    try:
        handler = transport._server.RequestHandlerClass
        # torchft's own handler (a class made per transport), with the per-request line dropped
        (base,) = handler.__bases__
        assert base.__qualname__ == "HTTPTransport.__init__.<locals>.RequestHandler"
        assert handler.__name__ == base.__name__
        assert handler.log_request is not BaseHTTPRequestHandler.log_request
        assert handler.log_error is BaseHTTPRequestHandler.log_error  # errors are still said
    finally:
        transport.shutdown(wait=True)
        transport._server.server_close()
