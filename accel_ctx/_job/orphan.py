"""A worker that ends with the launcher that started it.

torchrun's agent stops its workers when it is told to (SIGTERM, SIGINT); killed by SIGKILL (the
out-of-memory killer, ``kill -9``) it tells nobody, and its workers train on as orphans. In a
replica group they would go on taking part in the others' quorums after their group was
reported gone, so a replica group's worker asks Linux for a signal when its parent dies.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def end_with_parent(signum: int = signal.SIGTERM) -> bool:
    """Ask for ``signum`` when this process's parent dies (Linux's ``PR_SET_PDEATHSIG``, sent
    even when the parent is SIGKILLed); False where it cannot be asked (another system, no
    prctl). A parent that dies while this asks sends it at once; one that died before this
    process could ask is not seen.

    >>> end_with_parent(0)  # 0: asks for nothing, undoes an earlier request
    True
    """
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):  # another libc
        return False
    if signum and os.getppid() != parent:  # it died while this was asked
        os.kill(os.getpid(), signum)
    return True
