"""Preemption signals inside ``resumable()``: SIGTERM and SIGUSR1 ask for a save, then an exit.

The handler only notes the signal; the run saves at its next step boundary, every rank
together (see ``resume_run``), and leaves with :class:`Preempted` (exit code 128 + the
signal's number, which ``accel-ctx launch --max-restarts`` and a SLURM requeue restart).

A rank whose peer has died never reaches that boundary (torchrun SIGTERMs the survivors and
SIGKILLs them 30 s later): a watcher thread, woken through ``signal.set_wakeup_fd`` even while
the main thread waits in native code, ends the process after ``ACCEL_CTX_PREEMPT_GRACE``
seconds (default 20) unless a save has started by then; a save under way is waited for.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from typing_extensions import override

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
SCONTROL_ENV = "ACCEL_CTX_SCONTROL"  # the command run as `scontrol` (tests: a stand-in)
GRACE_ENV = "ACCEL_CTX_PREEMPT_GRACE"
DEFAULT_GRACE = 20.0


class Preempted(SystemExit):
    """A preemption signal arrived; the run saved its checkpoint and leaves to be restarted."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(128 + signum)
        self.signum = signum
        self.message = message

    @override
    def __str__(self) -> str:
        return self.message


def requeue() -> str:
    """Under SLURM (``SLURM_JOB_ID`` set), ask SLURM to requeue the job: ``scontrol requeue
    $SLURM_JOB_ID`` (``ACCEL_CTX_SCONTROL`` names another command). What happened, for the
    save-on-signal line ("" outside SLURM)."""
    import subprocess

    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return ""
    command = [os.environ.get(SCONTROL_ENV, "scontrol"), "requeue", job]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f" `{' '.join(command)}` failed ({exc})."
    if done.returncode != 0:
        return (f" `{' '.join(command)}` failed (exit {done.returncode}: "
                f"{done.stderr.strip()[:200]}).")
    return f" SLURM job {job} requeued."


class Signals:
    """The signal handlers of one ``resumable()`` entry, and what they noted."""

    def __init__(self) -> None:
        self.requested = 0
        self.boundary_reached = False  # a save started after the signal (the watcher stands down)
        self.saving = False
        self._previous: dict[int, Any] = {}
        self._wakeup: tuple[int, int] | None = None
        self._old_fd = -1

    def install(self) -> Callable[[], None]:
        """Handle SIGTERM and SIGUSR1 (main thread only: elsewhere nothing is installed)."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._note)
        read, write = os.pipe()
        os.set_blocking(write, False)
        try:
            self._old_fd = signal.set_wakeup_fd(write)
        except ValueError:
            os.close(read)
            os.close(write)
        else:
            if self._old_fd != -1:  # someone else's (an event loop): leave theirs in place
                signal.set_wakeup_fd(self._old_fd)
                os.close(read)
                os.close(write)
            else:
                self._wakeup = (read, write)
                threading.Thread(target=self._watch, args=(read,), daemon=True,
                                 name="accel_ctx-preempt").start()
        return self.uninstall

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        if self._wakeup is not None:
            signal.set_wakeup_fd(-1)
            read, write = self._wakeup
            self._wakeup = None
            os.close(write)  # the watcher reads the end of the pipe and leaves
            with contextlib.suppress(OSError):
                os.close(read)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if not self.requested:
            self.requested = signum

    def _watch(self, read: int) -> None:
        ours = {int(s) for s in SIGNALS}
        numbers: list[int] = []
        while not numbers:  # other signals (SIGINT) pass through the same pipe
            try:
                data = os.read(read, 16)
            except OSError:
                return
            if not data:  # uninstalled
                return
            numbers = [b for b in data if b in ours]
        try:
            grace = float(os.environ.get(GRACE_ENV, DEFAULT_GRACE))
        except ValueError:
            grace = DEFAULT_GRACE
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline or self.saving:
            if self.boundary_reached or self._wakeup is None:
                return
            time.sleep(0.05)
        if self.boundary_reached or self._wakeup is None:
            return
        name = signal.Signals(numbers[0]).name
        print(f"accel_ctx resumable(): {name} arrived and no step boundary came within "
              f"{grace:g} s (a peer has most likely died): exiting without saving; the last "
              "checkpoint is kept.", file=sys.stderr, flush=True)
        os._exit(128 + numbers[0])
