"""Signals the launcher passes on to its workers.

torchrun forwards SIGTERM, SIGINT, SIGHUP and SIGQUIT to the workers it starts (each in a
session of its own); SIGUSR1, which SLURM's ``--signal=USR1@90`` and spot-instance notices send
ahead of a preemption, would stop at the launcher. Forwarded, it reaches ``resumable()`` in
each worker, which saves at its next step boundary and exits to be restarted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Iterator
from typing import Any

from typing_extensions import override


@contextlib.contextmanager
def forward_sigusr1() -> Iterator[None]:
    """SIGUSR1 to the launcher (SLURM's ``--signal=USR1@90``, a spot notice) goes to its
    workers, which torchrun starts in sessions of their own and forwards only SIGTERM, SIGINT,
    SIGHUP and SIGQUIT to: under ``resumable()`` they save and exit to be restarted."""
    if not hasattr(signal, "SIGUSR1"):  # pragma: no cover - Windows
        yield
        return

    def forward(signum: int, frame: Any) -> None:
        for pid in children_of(os.getpid()):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, forward)
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, previous)


def children_of(parent: int) -> list[int]:
    """The processes whose parent is ``parent`` (Linux: read from /proc; elsewhere none).

    Examples:
        >>> from accel_ctx._launch.signals import children_of
        >>> children_of(-1)
        []
    """
    found = []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == parent:
                found.append(int(entry.name))
    return found


class _DropSignalShutdown(logging.Filter):
    """Drops torchrun's lines about a signal to the launcher (it says so in one line itself)."""

    signalled = False

    @override
    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        self.signalled = self.signalled or "death signal" in text
        return not (self.signalled and ("death signal" in text or "closing signal" in text))


@contextlib.contextmanager
def quiet_signal_shutdown() -> Iterator[None]:
    """While torchrun runs: its own lines about a signal to the launcher are dropped (the
    launcher says it in one line itself); its other lines stay.

    Examples:
        >>> from accel_ctx._launch.signals import quiet_signal_shutdown
        >>> with quiet_signal_shutdown():
        ...     pass
    """
    loggers = [logging.getLogger(f"torch.distributed.elastic.{name}")
               for name in ("agent.server.api", "multiprocessing.api")]
    quiet = _DropSignalShutdown()
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)
