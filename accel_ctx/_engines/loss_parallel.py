"""Torch's ``loss_parallel()`` on while a ``loss_parallel=True`` scope is open.

Apart from the tensor-parallel styles so that opening ``distributed()`` loads no DTensor code:
``torch.distributed.tensor`` is imported on the first ``loss_parallel=True`` scope only.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from .._kernel import state as _state

_lock = threading.Lock()
_open: list[contextlib.AbstractContextManager[None]] = []
_users = [0]


@contextlib.contextmanager
def loss_parallel_on() -> Iterator[None]:
    """Torch's ``loss_parallel()`` on while any ``loss_parallel=True`` scope is open (it swaps
    DTensor's cross-entropy ops process-wide: entered once, left by the last scope)."""
    from torch.distributed.tensor.parallel import loss_parallel

    with _lock:
        if _users[0] == 0:
            entered = loss_parallel()
            entered.__enter__()
            _open.append(entered)
        _users[0] += 1
    try:
        yield
    finally:
        with _lock:
            _users[0] -= 1
            if _users[0] == 0 and _open:
                _open.pop().__exit__(None, None, None)


def _forget_in_forked_child() -> None:
    global _lock
    _lock = threading.Lock()
    _users[0] = 0
    _open.clear()


_state.reset_after_fork(_forget_in_forked_child)
