"""The heartbeat: one rank's progress published about once a second, and its waits said aloud.

A daemon thread per process group (``distributed()`` with several processes starts it and
stops it) writes the rank's :class:`~accel_ctx._job.progress.Progress` to the rendezvous store
every ``INTERVAL_S`` seconds, with the line the training thread is on and whether it is blocked
inside torch.distributed. While the training thread waits (in one of our collectives or sync
points, or blocked inside torch.distributed: an FSDP all-gather, a collective of the user's
own), the same thread logs a line every ``ACCEL_CTX_PROGRESS_S`` seconds (default 30) on the
``accel_ctx`` logger, at WARNING, saying what this rank waits in and where the other ranks are::

    rank 1 of 2 waiting for 30 s at step 2, in wait_for_everyone() (at train.py:9 in main);
    rank 0: step 2, in forward (at train.py:7 in main)

After each beat, ``on_beat`` (``_group.stuck``) looks whether a call the training thread is blocked
in can still complete, from the others' records.

The rank's step is also copied, on each optimizer step, into a page of shared memory
(:class:`Mirror`), where the ranks on the same machine read it when this one's process is gone.
No store operation ever runs on the training thread.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import mmap
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import progress as _progress
from .progress import (
    BACKWARD,
    FAILED,
    LEFT,
    MIRROR_STEP,
    RUNNING,
    Progress,
    describe,
    last_seen,
    machine,
    process_gone,
    read,
    thread_state,
)

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

PROGRESS_VAR = "ACCEL_CTX_PROGRESS_S"
_log = logging.getLogger("accel_ctx")
_NAMED = 4  # other ranks named in a progress line
_SAME_CALL = "the other ranks are in the same call"
_MIRROR_PREFIX = "accel_ctx-step-"
_MIRROR_KEEP_S = 3600.0  # a dead rank's mirror stays this long for the ranks it left behind


def wait_interval(*names: str) -> float:
    """Seconds between progress lines: the first of the variables ``names`` that is set to a
    positive number, else ``ACCEL_CTX_PROGRESS_S``, else 30."""
    for name in (*names, PROGRESS_VAR):
        try:
            value = float(os.environ.get(name, ""))
        except ValueError:
            continue
        if value > 0:
            return value
    return 30.0


class Mirror:
    """The step of one rank, copied into a page of shared memory on each optimizer step.

    Its heartbeat publishes the rank's record about once a second; a process that dies (a
    signal, ``os._exit``) between two beats leaves an older record, and the others would name
    it where it was long before. Ranks on the same machine read its last step here instead
    (the path is in its record). The file is removed when the rank leaves ``distributed()``; a
    dead rank's file is removed by a later job on this machine after ``_MIRROR_KEEP_S``.
    """

    def __init__(self, progress: Progress) -> None:
        self.path = ""
        self._map: mmap.mmap | None = None
        folder = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
        with contextlib.suppress(OSError, ValueError):
            _sweep(folder)
            fd, self.path = tempfile.mkstemp(prefix=f"{_MIRROR_PREFIX}{os.getpid()}-",
                                             dir=folder)
            try:
                os.ftruncate(fd, MIRROR_STEP.size)
                self._map = mmap.mmap(fd, MIRROR_STEP.size)
            finally:
                os.close(fd)
            progress.mirror_to(self._map)

    def close(self, progress: Progress) -> None:
        progress.mirror_to(None)
        with contextlib.suppress(OSError, ValueError):
            if self._map is not None:
                self._map.close()
            if self.path:
                os.unlink(self.path)


def _sweep(folder: str) -> None:
    """Remove the mirrors that dead ranks left behind long ago."""
    now = time.time()
    for name in os.listdir(folder):
        if not name.startswith(_MIRROR_PREFIX):
            continue
        pid = name[len(_MIRROR_PREFIX):].partition("-")[0]
        path = os.path.join(folder, name)
        with contextlib.suppress(OSError, ValueError):
            if now - os.stat(path).st_mtime > _MIRROR_KEEP_S and not _alive(int(pid)):
                os.unlink(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


class Heartbeat:
    """Publishes one rank's :class:`Progress` to the store every ``INTERVAL_S`` seconds, and
    logs a progress line every ``wait_interval()`` seconds while the rank waits."""

    def __init__(self, progress: Progress, rank: int, store: Store, key: str,
                 world: int = 1) -> None:
        self.progress = progress
        self.key = key
        self.store = store
        self.rank, self.world = rank, world
        self.prefix = key.rsplit("/progress/", 1)[0]  # where the other ranks' records are
        self.interval = wait_interval()
        self.blocked = ""  # the torch.distributed function the training thread waits in
        self._waiting_since: tuple[Any, float] | None = None  # (position, since when)
        self._next_line = 0.0
        self.beat = 0
        self.thread_id = threading.get_ident()  # the training thread, whose line is shown
        self._dump: Any = None  # a temporary file faulthandler writes the threads' stacks to
        self.pid = os.getpid()
        self.host = machine()
        self.mirror: Mirror | None = None
        # called with this rank's record after each beat (``_group.stuck``: a rank blocked in a
        # collective that the others' records show will never complete ends there)
        self.on_beat: Callable[[dict[str, Any]], None] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # A store client of its own: a TCPStore connection is held for the whole of a wait()
        # (a barrier on the training thread), which would stall the heartbeat.
        try:
            self._own: Store = store.clone()  # type: ignore[attr-defined]
        except Exception:
            self._own = store
        self._thread = threading.Thread(
            target=self._run, name=f"accel-ctx-heartbeat-rank{rank}", daemon=True
        )

    def start(self) -> None:
        self.mirror = Mirror(self.progress)
        self._thread.start()

    def record(self) -> dict[str, Any]:
        p = self.progress
        self.beat += 1
        line, self.blocked = self._current_state()
        return {"step": p.step, "seq": p.seq, "phase": p.phase, "where": line or p.where,
                "beat": self.beat, "pid": self.pid, "host": self.host, "state": p.state,
                "detail": p.detail, "blames": list(p.blames), "waiting": p.waiting,
                "blocked": self.blocked, "mirror": self.mirror.path if self.mirror else "",
                "armed": p.armed, "raised": p.raised}

    def _current_state(self) -> tuple[str, str]:
        """The line the training thread is on now (a stalled rank: where it is stuck) and the
        torch.distributed function it waits in ("" if none).

        Read from a ``faulthandler`` dump, which walks the threads' frames in C while holding
        the GIL: walking them in Python (``sys._current_frames()``) races with the training
        thread popping its frames and can crash CPython 3.11.
        """
        if self._stop.is_set() or self._dump is None:  # the last record, as the rank leaves
            return "", ""
        try:
            self._dump.seek(0)
            self._dump.truncate()
            faulthandler.dump_traceback(self._dump, all_threads=True)
            self._dump.seek(0)
            return thread_state(self._dump.read(), self.thread_id)
        except Exception:  # no temporary folder, a closed file: the phase's line will do
            return "", ""

    def _report_wait(self, record: dict[str, Any]) -> None:
        """Every ``interval`` seconds at one position while waiting: one line saying so.

        A backward through DDP waits for the others inside the autograd engine, where no frame
        shows it: it counts as a wait only while another rank is elsewhere (a long backward on
        every rank is work, not a wait).
        """
        p = self.progress
        syncing = p.phase == BACKWARD and p.armed
        if p.state != RUNNING or not (record["waiting"] or record["blocked"] or syncing):
            self._waiting_since = None
            return
        position = (p.step, p.seq, p.phase)
        now = time.monotonic()
        if self._waiting_since is None or self._waiting_since[0] != position:
            self._waiting_since = (position, now)
            self._next_line = now + self.interval
            return
        if now < self._next_line:
            return
        self._next_line = now + self.interval
        with contextlib.suppress(Exception):  # a lost store only loses the line
            others = self.others()
            line = wait_line(self.rank, self.world, record, others,
                             now - self._waiting_since[1])
            if record["waiting"] or record["blocked"] or not line.endswith(_SAME_CALL):
                _log.warning("%s", line)

    def others(self) -> dict[int, dict[str, Any]]:
        """Every rank's last published record, read with this heartbeat's own store client (the
        training thread reads them too, rarely: ``_group.skipped``; one request at a time)."""
        with self._lock:
            return read(self._own, self.prefix, self.world)

    def publish(self, store: Store | None = None) -> dict[str, Any] | None:
        """Write the record now, and return it (never raises: a lost store only loses the
        information)."""
        with self._lock, contextlib.suppress(Exception):
            record = self.record()
            (store or self._own).set(self.key, json.dumps(record))
            return record
        return None

    def _run(self) -> None:
        with contextlib.ExitStack() as files:
            with contextlib.suppress(OSError):  # none: the records give the phase's line
                self._dump = files.enter_context(tempfile.TemporaryFile(mode="w+"))
            while not self._stop.is_set():
                record = self.publish()
                if record is not None:
                    self._report_wait(record)
                    if self.on_beat is not None:
                        with contextlib.suppress(Exception):  # a lost store: the next beat
                            self.on_beat(record)
                self._stop.wait(_progress.INTERVAL_S)
            with self._lock:
                self._dump = None

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        if self.mirror is not None:
            self.mirror.close(self.progress)


def wait_line(rank: int, world: int, mine: dict[str, Any], others: dict[int, dict[str, Any]],
              seconds: float) -> str:
    """"rank 1 of 2 waiting for 30 s at step 2, in wait_for_everyone() (at train.py:9 in main);
    rank 0: step 2, in forward (at train.py:7 in main)": this rank's wait, where the others are.
    """
    text = f"rank {rank} of {world} waiting for {seconds:.0f} s at {describe(mine)}{_inside(mine)}"
    here = _call(mine)
    elsewhere = [r for r, rec in sorted(others.items()) if r != rank and _call(rec) != here]
    silent = sorted(set(range(world)) - set(others) - {rank})
    parts = [f"rank {r}: {_state_of(others[r])}" for r in elsewhere[:_NAMED]]
    if len(elsewhere) > _NAMED:
        parts.append(f"{len(elsewhere) - _NAMED} more ranks elsewhere")
    if silent:
        parts.append(f"rank(s) {silent[:_NAMED]} published nothing yet")
    return "; ".join([text, *(parts or [_SAME_CALL])])


def _call(record: dict[str, Any]) -> tuple[Any, ...]:
    """Where a rank is, as far as telling "the same call" goes: its place in the step, the line,
    and the torch.distributed call it is blocked in (a barrier on one rank and an all_reduce
    on the other, both after the same optimizer step, are not the same call)."""
    return (record.get("step"), record.get("seq"), record.get("phase"), record.get("where"),
            record.get("blocked"))


def _inside(record: dict[str, Any]) -> str:
    return f", inside torch.distributed's {record['blocked']}()" if record.get("blocked") else ""


def _state_of(record: dict[str, Any]) -> str:
    state = record.get("state")
    if state == LEFT:
        return f"left distributed() at {describe(record)}"
    if state == FAILED:
        return f"failed at {describe(record)}"
    if process_gone(record):
        return f"its process died (last seen at {last_seen(record)})"
    return describe(record) + _inside(record)
