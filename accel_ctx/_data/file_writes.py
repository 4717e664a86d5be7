"""Whether a thread wrote files of its own between two moments: an evaluation whose results went
to per-rank files (``_data.eval_passes``) combined nothing across the ranks, and is right.

Two signals, read only at an evaluation pass's start and at its verdict, never per batch:

- files opened for writing by the thread after the start (Python's ``open``, ``pathlib``'s
  writes, ``os.open``, so also NumPy's, pandas', ``json.dump``'s and ``torch.save`` to an
  opened file), seen by an audit hook (``sys.addaudithook``, added at the first pass sharded
  over several ranks; it cannot be removed: any other audited event costs it one comparison).
  Bytecode, torch's compile caches and the files accel_ctx itself writes (``log_metrics``,
  checkpoints) are not the loop's results;
- files the process held open for writing at the start (``with open(...) as f:`` around the
  loop) that grew by the verdict. Standard output and error, the job's ``FileStore`` file and
  ``logging``'s files (a ``FileHandler`` opened in the pass too) are not results.

Not seen: ``torch.save(x, path)`` with a path, whose file torch's C++ writer opens (no audit
event): such a loop is told what to do (``wait_for_everyone()``), as before.
"""

from __future__ import annotations

import logging
import os
import stat
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_PACKAGE = str(Path(__file__).resolve().parents[1])  # accel_ctx/
_LOGGING = os.path.dirname(logging.__file__)
_NOT_RESULTS = ("__pycache__", "torchinductor", "triton", "torch_compile", "torch_extensions")
# per thread (threading.get_ident()): files opened for writing that may hold results
_opened: dict[int, int] = {}
# the latest files accel_ctx opened for writing (TensorBoard's events stay open and grow)
_ours: dict[str, None] = {}
_OURS_KEPT = 256
_hooked = False
_hook_lock = threading.Lock()


@dataclass(frozen=True)
class Writes:
    """A thread's file writes so far (compared, never read on their own)."""

    thread: int  # threading.get_ident()
    opened: int  # files it opened for writing since the hook was added
    open_files: tuple[tuple[str, int], ...]  # (path, size) of files open for writing


def now(store_file: str | None = None) -> Writes:
    """This thread's writes so far; the first call adds the audit hook. ``store_file``: the
    job's FileStore file, which holds no results."""
    global _hooked
    if not _hooked:
        with _hook_lock:
            if not _hooked:
                sys.addaudithook(_on_audit)
                _hooked = True
    thread = threading.get_ident()
    return Writes(thread, _opened.get(thread, 0), _open_for_writing(store_file))


def wrote_files(start: Writes) -> bool:
    """Whether files were written since ``start``: its thread opened one, or a file open for
    writing at ``start`` grew."""
    if _opened.get(start.thread, 0) > start.opened:
        return True
    return any(_size(path) > size for path, size in start.open_files)


def _on_audit(event: str, args: tuple[Any, ...]) -> None:
    if event != "open":
        return
    try:  # a hook that raises would fail the open itself
        _note_open(*args)
    except Exception:  # nothing of ours may break the user's open()
        return


def _note_open(path: Any, mode: Any, flags: Any) -> None:
    if isinstance(flags, int) and flags:
        if not flags & _WRITE_FLAGS:
            return
    elif not (isinstance(mode, str) and any(c in mode for c in "wax+")):
        return
    if isinstance(path, int):
        return  # an open descriptor (os.fdopen): its file was opened before
    try:
        name = os.path.abspath(os.fsdecode(path))
    except TypeError:
        return
    if _not_results(name):
        return
    frame: Any = sys._getframe(2)  # the code that opened it (0, 1: this hook)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_LOGGING):
            return  # a logging handler's file: lines, not results
        if frame.f_code.co_filename.startswith(_PACKAGE):  # accel_ctx's checkpoints, metrics
            _ours[name] = None
            if len(_ours) > _OURS_KEPT:
                del _ours[next(iter(_ours))]
            return
        frame = frame.f_back
    thread = threading.get_ident()
    _opened[thread] = _opened.get(thread, 0) + 1


def _not_results(name: str) -> bool:
    """Bytecode, torch's caches, devices."""
    return name.startswith("/dev/") or any(part in name for part in _NOT_RESULTS)


def _open_for_writing(store_file: str | None) -> tuple[tuple[str, int], ...]:
    """(path, size) of the regular files this process holds open for writing (Linux's
    /proc/self/fd; elsewhere none), but for the ones that hold no results."""
    # standard output and error, and logging's files, by the file (a copy of stdout is stdout)
    skip = {_identity(fd) for fd in (0, 1, 2, *_logging_fds())} - {None}
    store = os.path.realpath(store_file) if store_file else None
    found = []
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return ()
    for fd in fds:
        try:
            with open(f"/proc/self/fdinfo/{fd}") as info:
                flags = next(int(line.split()[1], 8) for line in info
                             if line.startswith("flags:"))
            if not flags & (os.O_WRONLY | os.O_RDWR):
                continue
            path = os.readlink(f"/proc/self/fd/{fd}")
            status = os.stat(path)
        except (OSError, StopIteration, ValueError):
            continue  # closed meanwhile, or no file behind it (a socket, a pipe, a deleted file)
        if (stat.S_ISREG(status.st_mode) and path != store and path not in _ours
                and (status.st_dev, status.st_ino) not in skip and not _not_results(path)):
            found.append((path, status.st_size))
    return tuple(found)


def _logging_fds() -> set[int]:
    """The descriptors of logging's file handlers: their lines are not results."""
    fds = set()
    for ref in list(getattr(logging, "_handlerList", [])):
        handler = ref() if callable(ref) else None
        stream = getattr(handler, "stream", None)
        try:
            if stream is not None:
                fds.add(stream.fileno())
        except (OSError, ValueError, AttributeError):
            continue
    return fds


def _identity(fd: int) -> tuple[int, int] | None:
    try:
        status = os.fstat(fd)
    except OSError:
        return None
    return status.st_dev, status.st_ino


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0
