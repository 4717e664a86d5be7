"""Where each rank is: its last progress, published where the other ranks can read it.

The training hot path only sets attributes of a :class:`Progress` (the step, the phase: forward,
backward, optimizer step, a collective's name). A daemon heartbeat thread, started by
``distributed()`` when the job has several processes and stopped when it exits, publishes them
to the rendezvous store about once a second, with the line the main thread is running and a
beat counter; leaving the scope publishes a last record saying "left" or "failed". When a
collective fails, ``_blame`` reads these records to name the rank that stopped and where.
No store operation ever runs on the training thread per step.

Key (under the process group's sync prefix of ``_barrier``): ``<prefix>/progress/<rank>``, a
JSON object ``{step, seq, phase, where, beat, pid, host, state, detail, blames}``; ``state`` is
"running", "left" or "failed"; ``blames`` the ranks a failed rank found responsible.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import re
import socket
import sys
import tempfile
import threading
from types import CodeType
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

INTERVAL_S = 1.0
FORWARD, AFTER_FORWARD = "forward", "after forward"
BACKWARD, AFTER_BACKWARD = "backward", "after backward"
STEP, AFTER_STEP = "optimizer step", "after optimizer step"
RUNNING, LEFT, FAILED = "running", "left", "failed"

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_SKIPPED = (_PACKAGE_DIR, _TORCH_DIR)
# the standard library too: a wait in pathlib, threading or queue shows the caller's line
_STDLIB = os.path.dirname(os.path.abspath(contextlib.__file__))


class Progress:
    """One rank's last progress: plain attributes, set on the hot path for O(1) each."""

    __slots__ = ("_where", "armed", "blames", "detail", "phase", "seq", "state", "step")

    def __init__(self) -> None:
        self.step = 0  # optimizer steps taken (state().step)
        self.seq = 0  # phases entered since that step began (orders ranks within a step)
        self.phase = "before any forward"
        # a forward ran through a DDP engine (or, in rank-only code, a model DDP trains) and
        # its backward has not run yet: a backward in rank-only code would need every rank
        self.armed = False
        self.state = RUNNING
        self.detail = ""
        self.blames: list[int] = []
        # the user's line that entered the phase, formatted only when read (hot path)
        self._where: tuple[CodeType, int] | None = None

    def enter(self, phase: str) -> None:
        self.seq += 1
        self.mark(phase)

    def mark(self, phase: str) -> None:
        """Enter ``phase``, noting the user's line; called on the training thread itself."""
        self.phase = phase
        self._where = _user_code_line(sys._getframe(1))

    @property
    def where(self) -> str:
        """The user's line that entered the phase: "train.py:42 in main" ("" if none)."""
        return _format(self._where)

    def position(self) -> tuple[int, int]:
        return self.step, self.seq

    def describe(self) -> str:
        """"step 5, in forward" / "step 5, after optimizer step"."""
        return f"step {self.step}, {_phase(self.phase)}"


def describe(record: dict[str, Any]) -> str:
    """A published record's position: "step 5, in forward (at train.py:42 in loss_fn)"."""
    text = f"step {record.get('step', '?')}, {_phase(str(record.get('phase', '?')))}"
    where = record.get("where")
    return f"{text} (at {where})" if where else text


def _phase(phase: str) -> str:
    return phase if phase.startswith(("after ", "before ")) else f"in {phase}"


def _is_users(filename: str) -> bool:
    if filename.startswith("<") or "/wrapt/" in filename:
        return False
    path = os.path.abspath(filename)
    if path.startswith(_SKIPPED):
        return False
    return not path.startswith(_STDLIB) or "-packages" in path


_USERS: dict[Any, bool] = {}  # code object -> whether it is the user's (cached: hot path)


def _user_code_line(frame: Any) -> tuple[CodeType, int] | None:
    """The code and line of the innermost frame outside accel_ctx, torch, wrapt and the
    standard library."""
    users_of = _USERS.get
    while frame is not None:
        code = frame.f_code
        users = users_of(code)
        if users is None:
            users = _USERS[code] = _is_users(code.co_filename)
        if users:
            return code, frame.f_lineno
        frame = frame.f_back
    return None


def _format(where: tuple[CodeType, int] | None) -> str:
    if where is None:
        return ""
    code, line = where
    return f"{os.path.basename(code.co_filename)}:{line} in {code.co_name}"


_FRAME_LINE = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def thread_line(dump: str, thread_id: int) -> str:
    """The user's innermost line of thread ``thread_id`` in a ``faulthandler`` dump."""
    header = f"hread 0x{thread_id:016x}"  # "Thread 0x..." or "Current thread 0x..."
    inside = False
    for line in dump.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            inside = header in line
            continue
        match = _FRAME_LINE.match(line) if inside else None
        if match is not None and _is_users(match.group(1)):
            return f"{os.path.basename(match.group(1))}:{match.group(2)} in {match.group(3)}"
    return ""


def here() -> str:
    """The user's line the calling thread is running.

    Only ever for the calling thread's own frames: walking another running thread's frames
    (``sys._current_frames()``) races with that thread popping them and can crash CPython.
    """
    return _format(_user_code_line(sys._getframe(1)))


class Heartbeat:
    """Publishes one rank's :class:`Progress` to the store every ``INTERVAL_S`` seconds."""

    def __init__(self, progress: Progress, rank: int, store: Store, key: str) -> None:
        self.progress = progress
        self.key = key
        self.store = store
        self.beat = 0
        self.thread_id = threading.get_ident()  # the training thread, whose line is shown
        self._dump: Any = None  # a temporary file faulthandler writes the threads' stacks to
        self.pid = os.getpid()
        self.host = machine()
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
        self._thread.start()

    def record(self) -> dict[str, Any]:
        p = self.progress
        self.beat += 1
        where = self._current_line() or p.where
        return {"step": p.step, "seq": p.seq, "phase": p.phase, "where": where,
                "beat": self.beat, "pid": self.pid, "host": self.host, "state": p.state,
                "detail": p.detail, "blames": list(p.blames)}

    def _current_line(self) -> str:
        """The line the training thread is on now (a stalled rank: where it is stuck).

        Read from a ``faulthandler`` dump, which walks the threads' frames in C while holding
        the GIL: walking them in Python (``sys._current_frames()``) races with the training
        thread popping its frames and can crash CPython 3.11.
        """
        if self._stop.is_set() or self._dump is None:  # the last record, as the rank leaves
            return ""
        try:
            self._dump.seek(0)
            self._dump.truncate()
            faulthandler.dump_traceback(self._dump, all_threads=True)
            self._dump.seek(0)
            return thread_line(self._dump.read(), self.thread_id)
        except Exception:  # no temporary folder, a closed file: the phase's line will do
            return ""

    def publish(self, store: Store | None = None) -> None:
        """Write the record now (never raises: a lost store only loses the information)."""
        with self._lock, contextlib.suppress(Exception):
            (store or self._own).set(self.key, json.dumps(self.record()))

    def _run(self) -> None:
        with contextlib.ExitStack() as files:
            with contextlib.suppress(OSError):  # none: the records give the phase's line
                self._dump = files.enter_context(tempfile.TemporaryFile(mode="w+"))
            while not self._stop.is_set():
                self.publish()
                self._stop.wait(INTERVAL_S)
            with self._lock:
                self._dump = None

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5.0)


def read(store: Store, prefix: str, world: int) -> dict[int, dict[str, Any]]:
    """Every rank's published record that exists (a rank that never published is left out)."""
    keys = [f"{prefix}/progress/{r}" for r in range(world)]
    out: dict[int, dict[str, Any]] = {}
    present = [r for r in range(world) if store.check([keys[r]])]
    if not present:
        return out
    for r, raw in zip(present, store.multi_get([keys[r] for r in present]), strict=True):
        with contextlib.suppress(ValueError):
            out[r] = json.loads(raw.decode())
    return out


_machine: list[str] = []


def machine() -> str:
    """This machine and pid namespace: host name, boot id and pid-namespace inode."""
    if not _machine:
        parts = [socket.gethostname()]
        with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
        with contextlib.suppress(OSError):
            parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
        _machine.append("/".join(parts))
    return _machine[0]


def process_gone(record: dict[str, Any]) -> bool:
    """Whether a record's process is known to have died (same host only: /proc or kill 0)."""
    if record.get("host") != machine():
        return False
    pid = int(record.get("pid", 0))
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False
