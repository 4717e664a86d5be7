"""The test harness's own hand-formed process groups, under the timing that made CI flaky."""

from __future__ import annotations

import os
import time
from typing import Any

import torch.distributed as dist

from .common import by_hand


def _rank() -> int:
    return dist.get_rank()


def two_groups_with_a_late_peer() -> list[int]:
    """Form two hand-written groups in a row while rank 1 is slow to close the first one.

    This is the timing that made about 1 CI run in 26 fail: rank 0 forms its next group while its
    peer still holds the previous group's rendezvous file open.
    """
    stock_destroy = dist.destroy_process_group

    def late_destroy(*args: Any, **kwargs: Any) -> None:
        if os.environ["RANK"] == "1":
            time.sleep(1.0)
        stock_destroy(*args, **kwargs)

    dist.destroy_process_group = late_destroy  # type: ignore[assignment]
    try:
        return [by_hand(_rank) for _ in range(3)]
    finally:
        dist.destroy_process_group = stock_destroy


def timeouts_seen() -> tuple[float, float]:
    """The factor a rank's own timeouts are scaled by, and 10 s scaled."""
    from .._timeouts import factor, scaled

    return factor(), scaled(10)


def sleep(seconds: float) -> None:
    time.sleep(seconds)
