"""Where each rank is: its last progress, published where the other ranks can read it.

The training hot path only sets attributes of a :class:`Progress` (the step, the phase: forward,
backward, optimizer step, a collective's name). A daemon heartbeat thread
(``_job.heartbeat``), started by ``distributed()`` when the job has several processes and stopped
when it exits, publishes them to the rendezvous store about once a second, with the line the
main thread is running and a beat counter; leaving the scope publishes a last record saying
"left" or "failed". When a
collective fails, ``_group.blame`` reads these records to name the rank that stopped and where.
No store operation ever runs on the training thread per step.

Key (under the process group's sync prefix of ``_group.barrier``): ``<prefix>/progress/<rank>``, a
JSON object ``{step, seq, phase, where, beat, pid, host, state, detail, blames, waiting,
blocked, mirror, armed, raised}``; ``state`` is "running", "left" or "failed"; ``blames`` the ranks a failed
rank found responsible; ``waiting`` whether the rank waits in a call of ours (a collective, a
sync point); ``blocked`` the torch.distributed function the training thread is inside ("" if
none), which tells a rank waiting at a sync point that this one waits in a collective instead;
``armed`` whether a backward that every rank must make is due; ``raised`` the last exception a
forward or backward raised on the rank (see ``Progress.raised``); ``mirror`` the file holding the rank's step, kept current on each optimizer step without a store
operation (see ``Mirror``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import struct
import sys
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

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # accel_ctx/
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
# where a thread waits for the other ranks: any function of c10d, and those of torch.distributed
# (FSDP's waits, DDP's checks in utils) and of DDP that communicate
_C10D = os.path.join(_TORCH_DIR, "distributed", "distributed_c10d.py")
_COMM_CODE = (os.path.join(_TORCH_DIR, "distributed") + os.sep,
              os.path.join(_TORCH_DIR, "nn", "parallel", "distributed.py"))
_COMM_WORDS = ("wait", "broadcast", "gather", "reduce", "scatter", "barrier", "sync", "verify")
MIRROR_STEP = struct.Struct("<q")  # a rank's step in its mirror (``_job.heartbeat.Mirror``)
_SKIPPED = (_PACKAGE_DIR, _TORCH_DIR)
# the standard library too: a wait in pathlib, threading or queue shows the caller's line
_STDLIB = os.path.dirname(os.path.abspath(contextlib.__file__))


class Progress:
    """One rank's last progress: plain attributes, set on the hot path for O(1) each."""

    __slots__ = ("_entered", "_mirror", "_step", "armed", "blames", "detail", "entered_at",
                 "on_unsynced_step", "phase", "raised", "seq", "state")

    def __init__(self) -> None:
        self._mirror: Any = None  # a shared page the step is copied to (_heartbeat.Mirror)
        self._step = 0  # optimizer steps taken (state().step)
        self.seq = 0  # phases entered since that step began (orders ranks within a step)
        self.phase = "before any forward"
        # a forward ran through a DDP engine (or, in rank-only code, a model DDP trains) and
        # its backward has not run yet: a backward in rank-only code would need every rank
        self.armed = False
        # called with the step when an optimizer step comes while armed (no backward since a
        # forward whose backward every rank must make): ``_group.skipped`` asks the others
        self.on_unsynced_step: Any = None
        self.state = RUNNING
        # the last exception a forward or backward raised on this rank that was not a
        # communication failure, and where ("ValueError: bad batch, at step 3, in forward"):
        # caught by the script, it explains why this rank is no longer where the others are
        self.raised = ""
        self.detail = ""
        self.blames: list[int] = []
        # the user's line that entered the wait of ours the rank is in, formatted only when read.
        # None in a phase of the training step (forward, backward, optimizer step: set a few
        # times per step, by plain assignments): walking the frames there costs a few percent
        # of a small compiled step, and the heartbeat reads the training thread's line from its
        # thread dump when it publishes (``Heartbeat.record``)
        self.entered_at: tuple[CodeType, int] | None = None
        self._entered = ""  # the last wait of ours entered (see ``waiting``)

    def enter(self, phase: str) -> None:
        """Enter a call of ours that waits for the other ranks (a collective, a sync point);
        it ends with the next phase (``"after ..."``). The user's line that made the call is
        noted: a wait's messages name it."""
        self.seq += 1
        self.phase = phase
        self.entered_at = _user_code_line(sys._getframe(1))
        self._entered = phase

    def hold(self) -> None:
        """Count as waiting where the rank is, without moving it (it judges a failed call):
        the others do not take it for a rank busy elsewhere."""
        self._entered = self.phase

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        if self.armed and self.on_unsynced_step is not None:  # the optimizer step, no backward
            self.on_unsynced_step(self._step)
        self._step = value
        if self.raised:  # stepping again: back with the others
            self.raised = ""
        if self._mirror is not None:  # once per optimizer step: a copy into shared memory
            MIRROR_STEP.pack_into(self._mirror, 0, value)

    def mirror_to(self, page: Any) -> None:
        """Copy the step into ``page`` (a writable buffer) from now on; None stops it."""
        self._mirror = page
        if page is not None:
            MIRROR_STEP.pack_into(page, 0, self._step)

    @property
    def waiting(self) -> bool:
        """Whether the rank is in a call of ours that waits for the others."""
        return self.phase is self._entered

    @property
    def where(self) -> str:
        """The user's line that entered the wait of ours the rank is in: "train.py:42 in main"
        ("" in a phase of the training step: see ``entered_at``)."""
        return _format(self.entered_at)

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


def last_seen(record: dict[str, Any]) -> str:
    """Where a rank whose process is gone really was: its record, or the step its shared
    mirror (``_job.heartbeat.Mirror``) shows when the record is older (a heartbeat publishes about
    once a second: a rank that dies soon after a step leaves a stale record behind)."""
    step = _mirrored_step(record)
    if step is None or step <= int(record.get("step", 0)):
        return describe(record)
    return f"step {step} (its last published record is from step {record.get('step')})"


def _mirrored_step(record: dict[str, Any]) -> int | None:
    """The step a record's mirror shows (same machine only), or None."""
    path = record.get("mirror")
    if not path or record.get("host") != machine():
        return None
    with contextlib.suppress(OSError, struct.error), open(path, "rb") as f:
        return int(MIRROR_STEP.unpack(f.read(MIRROR_STEP.size))[0])
    return None


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
    return thread_state(dump, thread_id)[0]


def thread_state(dump: str, thread_id: int) -> tuple[str, str]:
    """Thread ``thread_id``'s innermost line of the user's and the torch.distributed function
    it waits in ("" if its innermost frame is elsewhere), from a ``faulthandler`` dump."""
    header = f"hread 0x{thread_id:016x}"  # "Thread 0x..." or "Current thread 0x..."
    inside, innermost, blocked = False, True, ""
    for line in dump.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            inside = header in line
            continue
        match = _FRAME_LINE.match(line) if inside else None
        if match is None:
            continue
        path, function = os.path.abspath(match.group(1)), match.group(3)
        if innermost:  # faulthandler lists the innermost frame first
            innermost = False
            # a c10d collective, a wait on one issued asynchronously, DDP's broadcasts
            if path == _C10D or (path.startswith(_COMM_CODE) and any(
                    word in function for word in _COMM_WORDS)):
                blocked = function
        if _is_users(match.group(1)):
            return f"{os.path.basename(match.group(1))}:{match.group(2)} in {function}", blocked
    return "", blocked


def here() -> str:
    """The user's line the calling thread is running.

    Only ever for the calling thread's own frames: walking another running thread's frames
    (``sys._current_frames()``) races with that thread popping them and can crash CPython.
    """
    return _format(_user_code_line(sys._getframe(1)))


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
