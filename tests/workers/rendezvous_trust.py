"""Rendezvous that cannot complete (issue 11, point 9): each process reports what it saw."""

from __future__ import annotations

import logging
import time
from typing import Any

from accel_ctx import distributed


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def enter(timeout: float) -> dict[str, Any]:
    """Enter distributed() as the environment says; the error, the progress lines, the time."""
    lines = _Lines()
    logger = logging.getLogger("accel_ctx")
    logger.addHandler(lines)
    start = time.monotonic()
    error = None
    try:
        with distributed(timeout=timeout):
            pass
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        logger.removeHandler(lines)
    return {"error": error, "progress": lines.lines, "elapsed": time.monotonic() - start}
