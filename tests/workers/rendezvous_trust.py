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


def leave_at_once(delay: float) -> dict[str, list[float]]:
    """Scopes that end at once on every rank (the script's own error, before any collective)
    while rank 1 finishes forming its group ``delay`` seconds after torch's init returned: when
    each rank's group formed, and when each rank's scope body began (wall clock)."""
    import torch.distributed as dist

    from .._timeouts import scaled

    real = dist.init_process_group
    formed: list[float] = []
    began: list[float] = []

    def late(*args: Any, **kwargs: Any) -> None:
        real(*args, **kwargs)
        if dist.get_rank() == 1:
            time.sleep(delay)  # still connecting, as a slow rank's gloo full mesh can be
        formed.append(time.time())

    dist.init_process_group = late
    try:
        for _ in range(2):
            try:
                with distributed(timeout=scaled(60)):
                    began.append(time.time())
                    raise ValueError("the script's own error")
            except ValueError:
                pass
    finally:
        dist.init_process_group = real
    return {"formed": formed, "began": began}
