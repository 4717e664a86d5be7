"""Rendezvous that never waits in silence: progress lines while waiting, a named cause at the end.

Each rank reaches the rendezvous store (rank 0 serves it for ``env://``/``tcp://``), then waits
in the store until every rank arrived before the process group forms. While it waits it logs,
on the ``accel_ctx`` logger at WARNING (stderr when logging is not configured), a line every
``ACCEL_CTX_RDZV_PROGRESS_S`` seconds (default 30)::

    rank 1 of 2 waiting for the rendezvous at 127.0.0.1:29500: 1 of 2 arrived, 30 s

and it ends within the timeout with the likely cause: the port held by another program, ranks
started with different world sizes, two processes claiming the same rank, an address that does
not lead to rank 0 (rank 0's own included), or the ranks that never arrived. All of it happens once per process group, never per step.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

from torch._C._distributed_c10d import Store, TCPStore
from torch.distributed.rendezvous import rendezvous as _torch_rendezvous

from .._job import env as _env
from .._job.heartbeat import wait_interval
from ..errors import LaunchEnvironmentError, RendezvousError
from . import probe as _probe
from .keywait import KeyWait
from .probe import in_thread

PROGRESS_VAR = "ACCEL_CTX_RDZV_PROGRESS_S"
_log = logging.getLogger("accel_ctx")
_MAX_NAMED = 32  # ranks named in a message; larger jobs get counts
_SILENT_S = 5.0  # a store answers a client at once; a port silent this long is looked at


def progress_interval() -> float:
    """Seconds between progress lines (``ACCEL_CTX_RDZV_PROGRESS_S``, else
    ``ACCEL_CTX_PROGRESS_S``, default 30)."""
    return wait_interval(PROGRESS_VAR)


class Waiter:
    """Deadline and progress lines of one rendezvous."""

    def __init__(self, launch: _env.LaunchEnv, address: str, timeout: timedelta) -> None:
        self.who = f"rank {launch.coordinates.rank} of {launch.coordinates.world_size}"
        self.source = launch.source
        self.address = address
        self.timeout = timeout.total_seconds()
        self.start = time.monotonic()
        self.deadline = self.start + self.timeout
        self.interval = progress_interval()
        self.next_line = self.start + self.interval
        self.serving = False  # this process serves the store (rank 0 for env:// and tcp://)
        self.shared_port = False  # rank 0 found another process serving a store on its port

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def poll_s(self) -> float:
        return max(0.05, min(1.0, self.interval, self.left()))

    def tick(self, status: str) -> None:
        now = time.monotonic()
        if now >= self.next_line:
            self.next_line = now + self.interval
            _log.warning(
                "%s waiting for the rendezvous at %s: %s, %.0f s",
                self.who, self.address, status, now - self.start,
            )

    def fail(self, cause: str, fix: str) -> RendezvousError:
        return RendezvousError(
            f"{self.who} ({self.source}): the rendezvous at {self.address} did not complete: "
            f"{cause}. {fix}"
        )


def _host_port(launch: _env.LaunchEnv, init_method: str | None) -> tuple[str, int] | None:
    """Where rank 0's TCPStore is (tcp:// or env://), or None for other rendezvous kinds."""
    if init_method is None or init_method.startswith("env://"):
        if launch.master_addr is None or launch.master_port is None:
            raise LaunchEnvironmentError(
                f"rank {launch.coordinates.rank} of {launch.coordinates.world_size}: MASTER_ADDR and MASTER_PORT must "
                "be set for the rendezvous (the launcher sets them); or pass "
                "distributed(init_method='file:///shared/path')."
            )
        return launch.master_addr, launch.master_port
    if init_method.startswith("tcp://"):
        url = urlparse(init_method)
        if url.hostname is None or url.port is None:
            raise LaunchEnvironmentError(
                f"init_method {init_method!r} names no host:port; write tcp://HOST:PORT."
            )
        return url.hostname, url.port
    return None


def address_of(launch: _env.LaunchEnv, init_method: str | None) -> str:
    """The rendezvous address as messages show it (host:port, or the URL)."""
    if init_method is None or init_method.startswith("env://"):
        return f"{launch.master_addr}:{launch.master_port}"
    if init_method.startswith("tcp://"):
        return urlparse(init_method).netloc
    return init_method


def connect(launch: _env.LaunchEnv, init_method: str | None, timeout: timedelta,
            waiter: Waiter) -> Store:
    """The rendezvous store, reached within the timeout with progress lines while connecting."""
    hp = _host_port(launch, init_method)
    if hp is None:
        assert init_method is not None
        store: Store = next(
            _torch_rendezvous(init_method, launch.coordinates.rank, launch.coordinates.world_size, timeout=timeout)
        )[0]
        return store
    host, port = hp
    if launch.coordinates.rank == 0 and not launch.use_agent_store:
        return _serve(host, port, launch, timeout, waiter)
    return _connect_client(host, port, launch, timeout, waiter)


def _serve(host: str, port: int, launch: _env.LaunchEnv, timeout: timedelta,
           waiter: Waiter) -> Store:
    """Rank 0 serves the store on ``port``; TCPStore then connects to it at ``host:port``,
    which retries until the timeout (in torch's C++ warnings) when ``host`` does not lead back
    to this machine: so it runs in a daemon thread while this one reports progress."""
    got = _within(lambda: TCPStore(host, port, launch.coordinates.world_size, is_master=True,
                                   timeout=timeout, wait_for_workers=False, multi_tenant=True),
                  waiter, f"serving the store on port {port} and connecting to it at {host}")
    if got and not isinstance(got[0], BaseException):
        store: Store = got[0]
        waiter.serving = True
        return store
    if got and _probe.address_in_use(got[0]):
        if _probe.what_answers(host, port, min(10.0, max(1.0, waiter.left()))) == _probe.STORE:
            # Another process serves a store there: a second process started with RANK=0
            # (the rendezvous in that store says so), or another job on this port.
            waiter.shared_port = True
            return _connect_client(host, port, launch, timeout, waiter)
        raise waiter.fail(
            f"port {port} is held by another program, so rank 0 cannot serve the rendezvous "
            "store there (address already in use)",
            "Free the port, or start the job on another one (MASTER_PORT, "
            "`accel-ctx launch --master-port`).",
        ) from got[0]
    local = _probe.is_local_address(host)
    cause = (f"rank 0 serves the store on port {port} but could not reach it at {host}:{port} "
             f"within {waiter.timeout:g} s")
    if not local:
        cause += f": MASTER_ADDR={host} is not an address of this host, which rank 0 runs on"
    elif got:
        cause += f" ({got[0]})"
    raise waiter.fail(cause, (
        "Set MASTER_ADDR to an address of rank 0's host that every rank reaches (the "
        "launcher sets it), or pass distributed(init_method='file:///shared/path')."
    )) from (got[0] if got else None)


def _within(make: Any, waiter: Waiter, doing: str) -> list[Any]:
    """``[make()]`` or ``[its exception]`` within the deadline, with progress lines; ``[]`` at
    the deadline (it goes on in a daemon thread: TCPStore's constructor can block past its
    timeout)."""
    thread, result = in_thread(make, "accel_ctx-rendezvous")
    while not result and waiter.left() > 0:
        thread.join(waiter.poll_s())
        waiter.tick(doing)
    return result


def _connect_client(host: str, port: int, launch: _env.LaunchEnv, timeout: timedelta,
                    waiter: Waiter) -> Store:
    thread, got = in_thread(lambda: TCPStore(host, port, launch.coordinates.world_size,
                                             is_master=False, timeout=timeout,
                                             wait_for_workers=False), "accel_ctx-rendezvous")
    began, look = time.monotonic(), None
    while not got and waiter.left() > 0:
        thread.join(waiter.poll_s())
        waiter.tick("connecting to rank 0's store")
        # Something that accepts the connection and never answers is no store: a port held by
        # another program (started by hand, rank 0 then fails alone), which the client would
        # wait on for the whole timeout. A store answers at once; a probe tells them apart.
        if look is None and not got and time.monotonic() - began > _SILENT_S:
            look = in_thread(lambda: _probe.what_answers(host, port, _SILENT_S), "accel_ctx-probe")
        if look is not None and look[1] and not got:
            if look[1][0] == _probe.OTHER:
                raise waiter.fail(_held(host, port), f"Free port {port}, or start every rank "
                                  "with another MASTER_PORT (one nothing else listens on).")
            look, began = None, time.monotonic()  # nothing there yet, or a store: look again
    if got and not isinstance(got[0], BaseException):
        store: Store = got[0]
        return store
    cause = _diagnose(host, port)
    raise waiter.fail(cause, (
        f"Start rank 0 first or together with the others, and check that MASTER_ADDR/"
        f"MASTER_PORT ({host}:{port}) is rank 0's address and reachable from this host; "
        "raise distributed(timeout=...) if start-up is slow."
    )) from (got[0] if got else None)


def _diagnose(host: str, port: int) -> str:
    """Why no store answered at host:port: nothing listens, or something else holds the port."""
    error = _probe.connect_error(host, port)
    if isinstance(error, ConnectionRefusedError):
        return f"nothing listens at {host}:{port} (rank 0 not started, or the port is wrong)"
    if error is not None:
        return f"the address {host}:{port} is unreachable from this host ({error})"
    return _held(host, port)


def _held(host: str, port: int) -> str:
    return (f"something accepts connections at {host}:{port} but it is not a rendezvous store: "
            f"port {port} is likely held by another program")


def await_peers(store: Store, launch: _env.LaunchEnv, waiter: Waiter) -> None:
    """Wait in ``store`` until all ranks arrived; fail fast on a world-size or rank clash."""
    try:
        _await_peers(store, launch, waiter)
    except RendezvousError:
        raise
    except Exception as exc:  # the store itself went away: its host (rank 0) has stopped
        raise waiter.fail(
            f"the rendezvous store closed while this rank waited ({exc}): rank 0, which serves "
            "it, most likely stopped",
            "See rank 0's message for the cause (for example ranks started with different "
            "WORLD_SIZE).",
        ) from exc


def _await_peers(store: Store, launch: _env.LaunchEnv, waiter: Waiter) -> None:
    world, rank = launch.coordinates.world_size, launch.coordinates.rank
    seen = store.compare_set("rdzv/world_size", "", str(world)).decode()
    if seen != str(world):
        cause = (f"world size mismatch seen in the store: rank {rank} was started with "
                 f"WORLD_SIZE={world}, a rank before it with WORLD_SIZE={seen}")
        raise _report(store, cause, waiter,
                      "Start every rank of the job with the same WORLD_SIZE.")
    if store.add(f"rdzv/rank/{rank}", 1) > 1:
        also = (" (or another job on this port serves its store there)"
                if waiter.shared_port else "")
        raise _report(store, f"two processes claim rank {rank}: both were started with "
                      f"RANK={rank}{also}", waiter,
                      "Give every process its own RANK from 0 to WORLD_SIZE-1.")
    arrived = store.add("rdzv/arrived", 1)
    if arrived >= world:
        store.set("rdzv/all", "1")

    def look() -> None:
        if store.check(["rdzv/problem"]):
            cause = store.get("rdzv/problem").decode()
            store.add("rdzv/problem_seen", 1)
            _linger(store, waiter)
            raise waiter.fail(f"another rank reports: {cause}",
                              "Start every rank of the job with the same settings.")
        waiter.tick(f"{store.add('rdzv/arrived', 0)} of {world} arrived")

    try:
        KeyWait(store).wait("rdzv/all", max(0.0, waiter.left()), look, waiter.poll_s())
    except RendezvousError:
        raise
    except RuntimeError:
        if store.check(["rdzv/all"]):
            return
        if waiter.left() > 0:
            raise  # the store was lost: await_peers says so
        arrived = store.add("rdzv/arrived", 0)
        missing = _missing(store, world)
        raise waiter.fail(
            f"{arrived} of {world} processes arrived within {waiter.timeout:g} s; {missing}",
            f"Start all {world} processes (WORLD_SIZE={world}) with the same rendezvous "
            "address, or raise distributed(timeout=...) if start-up is slow.",
        ) from None


def await_formed(store: Store, launch: _env.LaunchEnv, waiter: Waiter) -> None:
    """After the group formed on this rank, wait until it formed on every rank.

    A rank whose side of gloo's full mesh is connected may go on while a slower rank still
    finishes its own; were it to leave the scope at once (an error before any collective) and
    destroy its group, the slower rank's connection would fail with gloo's "Connection closed
    by peer", blaming nobody. One counter in the store, read while the ranks are together.
    """
    world = launch.coordinates.world_size
    if store.add("rdzv/formed", 1) >= world:
        store.set("rdzv/formed_all", "1")

    def look() -> None:
        waiter.tick(f"the group formed on {store.add('rdzv/formed', 0)} of {world}")

    try:
        KeyWait(store).wait("rdzv/formed_all", max(0.0, waiter.left()), look, waiter.poll_s())
    except RuntimeError as exc:
        if store.check(["rdzv/formed_all"]):
            return
        raise waiter.fail(
            f"the process group formed on {store.add('rdzv/formed', 0)} of {world} processes "
            f"({exc})", "See the other ranks' messages for the cause.") from exc


def _report(store: Store, cause: str, waiter: Waiter, fix: str) -> RendezvousError:
    """Publish ``cause`` for the waiting ranks; the error for this one."""
    store.set("rdzv/problem", cause)
    _linger(store, waiter)
    return waiter.fail(cause, fix)


def _linger(store: Store, waiter: Waiter) -> None:
    """The rank serving the store (rank 0 for env:// and tcp://) stays a moment, until the
    ranks that arrived have read the problem, so that its exit does not leave them only
    "connection closed"."""
    if not waiter.serving:
        return
    until = time.monotonic() + min(5.0, max(0.0, waiter.left()))
    while (int(store.add("rdzv/problem_seen", 0)) < int(store.add("rdzv/arrived", 0))
           and time.monotonic() < until):
        time.sleep(0.05)


def _missing(store: Store, world: int) -> str:
    if world > _MAX_NAMED:
        return "some ranks never arrived"
    missing = [r for r in range(world) if not store.check([f"rdzv/rank/{r}"])]
    return f"rank(s) {missing} never arrived"
