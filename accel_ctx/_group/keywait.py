"""Waiting for a key of the rendezvous store while the waiting thread keeps looking around.

Our waits (sync points, the rendezvous, find_executable_batch_size's vote) must notice a rank
that will never come and say what they wait for, so they cannot block in one long
``store.wait``. Short ``TCPStore.wait`` calls log two lines of C++ warnings each time one times
out (1,142 lines in a ten-minute wait), and polling with ``check`` loads the store with every
rank's requests. So the wait itself runs in a helper thread, on a store client of its own (a
TCPStore connection is held for the whole of a wait), and wakes the caller the moment the key
is set; the caller looks around every ``every`` seconds meanwhile.

Examples:
    >>> from datetime import timedelta
    >>> from torch.distributed import HashStore
    >>> store = HashStore()
    >>> store.set("done", "ok")
    >>> KeyWait(store).wait("done", 5.0, look=lambda: None)
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

_POLL_S = 0.05  # the longest pause between two checks where a store cannot be cloned


class KeyWait:
    """Waits for keys of one store, one wait at a time (a free client is kept for the next)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self._client: Any = None  # a clone of ``store`` that no helper thread is waiting on

    def wait(self, key: str, seconds: float, look: Callable[[], None],
             every: float = 1.0) -> None:
        """Return once ``key`` is set; call ``look()`` every ``every`` seconds meanwhile (it may
        raise, or set the key itself). Raises RuntimeError after ``seconds``, or when the store
        is lost."""
        deadline = time.monotonic() + seconds
        client, self._client = self._client or self._clone(), None
        if client is None:
            self._poll(key, deadline, seconds, look, every)
            return
        woke = threading.Event()

        def run() -> None:
            with contextlib.suppress(Exception):  # the caller checks the key itself
                client.wait([key], timedelta(seconds=max(0.001, deadline - time.monotonic())))
            woke.set()

        threading.Thread(target=run, name="accel_ctx-wait", daemon=True).start()
        while not woke.wait(max(0.0, min(every, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise RuntimeError(f"no {key!r} within {seconds:g} s")
            look()
        if not self.store.check([key]):  # the helper's wait failed: the store is gone
            raise RuntimeError(f"the wait for {key!r} ended without it: the store was lost")
        self._client = client  # free again (a wait left behind keeps its own)

    def _clone(self) -> Any:
        try:
            return self.store.clone()
        except Exception:  # a store that cannot be cloned: polled instead
            return None

    def _poll(self, key: str, deadline: float, seconds: float, look: Callable[[], None],
              every: float) -> None:
        pause, next_look = 0.001, time.monotonic() + every
        while not self.store.check([key]):
            now = time.monotonic()
            if now >= deadline:
                raise RuntimeError(f"no {key!r} within {seconds:g} s")
            if now >= next_look:
                next_look = now + every
                look()
            time.sleep(max(0.0, min(pause, deadline - now)))
            pause = min(2 * pause, _POLL_S)
