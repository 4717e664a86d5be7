"""Whether an evaluation's results went to files between its start and its verdict: per-rank
prediction files (``_data.eval_passes``) combine nothing across the ranks, and are right.

The signal: the regular files the process holds open for writing at the pass's start (``with
open(...) as f:`` around the loop) that grew by the verdict, read from Linux's ``/proc/self``
at those two moments only (elsewhere: none seen). Standard output and error (and any copy of
them), ``logging``'s files, the job's ``FileStore`` file, ``log_metrics``' folders, bytecode
and torch's compile caches are not results.

Not seen: a file opened and written after the loop (``torch.save(x, path)``, ``json.dump``):
only a Python audit hook would see its ``open``, and one taxes every ``id()`` call of the
process for good (CPython audits it). Such a loop is told what to do (``wait_for_everyone()``).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass

_NOT_RESULTS = ("__pycache__", "torchinductor", "triton", "torch_compile", "torch_extensions")


@dataclass(frozen=True)
class Writes:
    """The files open for writing at a moment, with their sizes (compared, never read alone)."""

    open_files: tuple[tuple[str, int], ...]  # (path, size)


def now(store_file: str | None = None, folders: Iterable[str] = ()) -> Writes:
    """The files open for writing now that may hold results: not ``store_file`` (the job's
    FileStore) nor those under ``folders`` (log_metrics')."""
    return Writes(_open_for_writing(store_file, tuple(os.path.join(f, "") for f in folders)))


def wrote_files(start: Writes) -> bool:
    """Whether a file open for writing at ``start`` grew since."""
    return any(_size(path) > size for path, size in start.open_files)


def _open_for_writing(store_file: str | None,
                      folders: tuple[str, ...]) -> tuple[tuple[str, int], ...]:
    # standard output and error, and logging's files, by the file (a copy of stdout is stdout)
    skip = {_identity(fd) for fd in (0, 1, 2, *_logging_fds())} - {None}
    store = os.path.realpath(store_file) if store_file else None
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return ()
    found = []
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
        if (stat.S_ISREG(status.st_mode) and path != store
                and (status.st_dev, status.st_ino) not in skip
                and not path.startswith(folders)
                and not any(part in path for part in _NOT_RESULTS)):
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
