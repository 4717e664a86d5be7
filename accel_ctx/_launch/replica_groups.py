"""``accel-ctx launch --replica-groups R``: a lighthouse and R replica groups on this machine.

Each group is a launcher of its own (``accel-ctx launch`` with the same arguments, one
torchrun agent with its own rendezvous and its own ``--max-restarts``), told its index, the group
count and the lighthouse's address in torchft's variables. The lighthouse (torchft's, in this
process) forms a quorum of the live groups every step. The launcher ends when every group has
ended: 0 when all ended 0, else the first failing group's code.

On several machines the lighthouse runs on its own (``accel-ctx lighthouse``) and each group's
launcher is told where (``--lighthouse HOST:PORT --replica-group I``): :func:`group_env` gives
its workers the same variables, and :func:`unreachable` waits for the lighthouse to answer.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

from .._job import env as _env
from ..errors import AccelCtxError, ConfigurationError
from .settings import split_host_port
from .signals import children_of

LOOPBACK = "127.0.0.1:0"
"""Where the lighthouse of ``launch --replica-groups`` listens: its groups run on this machine."""
PARENT_VAR = "ACCEL_CTX_REPLICA_LAUNCHER"
"""The pid of ``launch --replica-groups`` in each group launcher's environment: it ends with it."""
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_STOPPING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_GRACE_S = 60.0  # a group's agent stops its workers (SIGTERM, 30 s, SIGKILL) within this
WILDCARDS = ("[::]", "0.0.0.0", "::", "")
"""Bind addresses meaning every interface: the groups dial a host of the machine instead."""

# accel_ctx has no release on PyPI: torchft itself, or the extra from where accel_ctx was installed
FT_INSTALL = ("pip install 'torchft>=0.2' (the package of accel_ctx's ft extra: in the accel_ctx "
              "clone `pip install -e '.[ft]'`, or `pip install 'accel-ctx[ft]'` where accel_ctx "
              "is installed)")
_NO_TORCHFT = (
    "--replica-groups needs torchft (its lighthouse and Manager): " + FT_INSTALL
    + ", or launch without --replica-groups.")


def wanted(settings: Mapping[str, object], environ: Mapping[str, str]) -> bool:
    """``--replica-groups R`` (R > 1) asked, and this launcher is not one group's already
    (started by :func:`run`, which gives it the group's index, or told ``--lighthouse``)."""
    return (int(str(settings.get("replica_groups", 1))) > 1 and "lighthouse" not in settings
            and not environ.get(_env.REPLICA_GROUP_VAR, ""))


def group_env(settings: Mapping[str, object]) -> dict[str, str]:
    """The variables of one group's workers under ``--lighthouse HOST:PORT --replica-group I``
    (none without ``--lighthouse``); a ConfigurationError for a group that cannot be."""
    group, groups = settings.get("replica_group"), int(str(settings.get("replica_groups", 1)))
    if ("lighthouse" in settings or groups > 1) and "replica_timeout" not in settings:
        # a bad ACCEL_CTX_REPLICA_TIMEOUT is named before anything starts (--replica-timeout
        # or the config file's replica_timeout replaces it)
        _env.replica_timeout()
    if "lighthouse" not in settings:
        if group is not None:
            raise ConfigurationError(
                f"--replica-group {group} needs --lighthouse HOST:PORT, the address of the "
                "`accel-ctx lighthouse` the groups meet at (on one machine, --replica-groups R "
                "alone starts the lighthouse and every group).")
        return {}
    if group is None and groups > 1:
        raise ConfigurationError(
            f"--lighthouse with --replica-groups {groups}: say which group this launcher "
            f"starts with --replica-group I (0 to {groups - 1}), a different one on each node.")
    index = int(str(group or 0))
    if index >= groups:
        raise ConfigurationError(
            f"--replica-group {index} with --replica-groups {groups}: the groups are numbered "
            f"0 to {groups - 1}; give --replica-groups the job's group count.")
    # torchft's Rust side logs every quorum at INFO (as in :func:`_run`): its warnings stay
    return {_env.LIGHTHOUSE_VAR: f"http://{settings['lighthouse']}",
            _env.REPLICA_GROUP_VAR: str(index), _env.REPLICA_GROUPS_VAR: str(groups),
            "RUST_LOG": os.environ.get("RUST_LOG", "warn")}


def unreachable(settings: Mapping[str, object], seconds: float | None = None) -> str:
    """Why this group's launcher cannot use ``--lighthouse``, or ''.

    The lighthouse may start a little after the groups: a connection is tried again until
    ``seconds`` have passed, before any worker starts (torchft's Manager would otherwise wait
    on it, silently, for its own timeouts). What answers must be a torchft lighthouse: its HTTP
    side serves a status page at ``GET /`` (beside the gRPC the Managers speak, on the same
    port); another program's port is named within a few seconds."""
    if seconds is None:
        seconds = _env.replica_timeout()
    address = str(settings.get("lighthouse") or "")
    host, port = split_host_port(address) or ("", 0)
    if not host:
        return ""
    deadline = time.monotonic() + seconds
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(5.0, seconds)) as conn:
                other = not_a_lighthouse(conn, host)
            if not other:
                return ""
            return (f"something answers at http://{address}, but it is not a torchft lighthouse "
                    f"({other}): another program holds that port, or --lighthouse names the "
                    "wrong one. Give the HOST:PORT that `accel-ctx lighthouse` printed "
                    "(\"listening at ...\").")
        except OSError as exc:
            why = exc.strerror or type(exc).__name__
        if time.monotonic() + 1 > deadline:
            break
        time.sleep(1)
    return (f"cannot reach the replica groups' lighthouse at http://{address} within "
            f"{seconds:g} s ({why}). Start `accel-ctx lighthouse --port {port}` on {host} "
            "first, or check --lighthouse (the host and port it printed).")


def not_a_lighthouse(conn: socket.socket, host: str, seconds: float = 5.0) -> str:
    """What the server on ``conn`` did instead of answering as a lighthouse, or ''.

    torchft's lighthouse answers ``GET /`` with its dashboard ("Lighthouse Dashboard -
    torchft"), at once."""
    conn.settimeout(seconds)
    answer = b""
    try:
        conn.sendall(f"GET / HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
        deadline = time.monotonic() + seconds
        while len(answer) < 65536 and time.monotonic() < deadline:
            data = conn.recv(65536)
            if not data:
                break
            answer += data
    except TimeoutError:
        if not answer:
            return f"it accepted the connection but sent nothing within {seconds:g} s"
    except OSError:  # reset: closed with our request unread
        pass
    if b"lighthouse" in answer.lower() and b"torchft" in answer.lower():
        return ""
    if not answer:
        return "it closed the connection without an answer"
    first = answer.split(b"\r\n", 1)[0].split(b"\n", 1)[0][:60].decode("ascii", "replace")
    return f"it answered {first!r}"


def start_lighthouse(bind: str = LOOPBACK, min_replicas: int = 1,
                     missing: str = _NO_TORCHFT) -> Any:
    """torchft's lighthouse at ``bind`` (default: loopback, a port the OS picks), any
    ``min_replicas`` groups a quorum. A group that stops beating is dropped after 2 s; a
    returning group joins within 1 s. ``missing``: the error without torchft."""
    try:
        from torchft.coordination import LighthouseServer
    except ImportError as exc:
        raise ConfigurationError(missing) from exc
    return LighthouseServer(bind=bind, min_replicas=min_replicas, join_timeout_ms=1000,
                            quorum_tick_ms=100, heartbeat_timeout_ms=2000)


def bracketed(host: str) -> str:
    """An IPv6 address in brackets, as ``HOST:PORT`` needs it; any other host as it is.

    Examples:
        >>> bracketed("::1"), bracketed("[::]"), bracketed("10.0.0.1")
        ('[::1]', '[::]', '10.0.0.1')
    """
    host = host.strip()
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def die_with_launcher(environ: MutableMapping[str, str]) -> bool:
    """In a group's launcher that ``launch --replica-groups`` started: end when it ends.

    Linux's ``PR_SET_PDEATHSIG`` sends this process SIGTERM when its parent dies, even by
    SIGKILL (torchrun's agent then stops the group's workers, as for any SIGTERM); elsewhere a
    thread watches the parent. False when the parent is gone already (it died before this
    process could ask): nothing may start then."""
    parent = environ.pop(PARENT_VAR, "")
    if not parent.isdigit():
        return True  # not started by run(): a launcher of its own
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        except (OSError, AttributeError):  # no prctl (another libc): the thread does it
            _watch_parent(int(parent))
    else:
        _watch_parent(int(parent))
    return os.getppid() == int(parent)


def _watch_parent(parent: int) -> None:
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="accel_ctx-parent-watch", daemon=True).start()


def run(argv: Sequence[str], groups: int, environ: Mapping[str, str],
        fail: Callable[[str, AccelCtxError], int], bind: object = None) -> int:
    """Start the lighthouse (at ``bind``, an address of this machine; default loopback) and
    ``groups`` launchers of ``argv`` (without the flag); wait."""
    try:
        return _run(argv, groups, environ, LOOPBACK if bind is None else f"{bracketed(str(bind))}:0")
    except AccelCtxError as exc:  # torchft missing: one line, exit code 1
        return fail("launch", exc)


def _run(argv: Sequence[str], groups: int, environ: Mapping[str, str], bind: str) -> int:
    # torchft's Rust side logs every quorum at INFO; its warnings and errors stay
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        lighthouse = start_lighthouse(bind)
    except RuntimeError as exc:  # an address that is not this machine's
        raise ConfigurationError(
            f"cannot start the lighthouse at {bind} ({exc}): give lighthouse_bind an address of "
            "this machine (127.0.0.1, the default, for groups on one machine).") from exc
    host = bind.rsplit(":", 1)[0]
    # the groups dial loopback when it listens on every interface: they run on this machine
    dial = "127.0.0.1" if host in WILDCARDS else host
    address = f"http://{dial}:{lighthouse.address().rsplit(':', 1)[1]}"
    print(f"accel-ctx launch: {groups} replica groups, lighthouse at {address}", file=sys.stderr)
    # each group's launcher gets the same command line: the group index in its environment
    # makes it one group's launcher (see wanted), whatever --replica-groups says
    rest = list(argv)
    children: list[subprocess.Popen[bytes]] = []
    stopping: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        stopping.append(signum)
        _signal_all(children, signum)

    previous = {s: signal.signal(s, on_signal) for s in _STOPPING}
    try:
        for group in range(groups):
            if stopping:
                break
            env = {**environ, "RUST_LOG": os.environ["RUST_LOG"], _env.LIGHTHOUSE_VAR: address,
                   _env.REPLICA_GROUP_VAR: str(group), _env.REPLICA_GROUPS_VAR: str(groups),
                   PARENT_VAR: str(os.getpid())}
            # a session of its own: a terminal's Ctrl-C reaches this launcher alone, which
            # passes it on once (twice, torchrun's agent would stop its shutdown half-way)
            children.append(subprocess.Popen(
                [sys.executable, "-m", "accel_ctx.cli", "launch", *rest], env=env,
                start_new_session=True))
        codes = _wait(children, stopping)
    finally:
        _stop(children)
        for signum, old in previous.items():
            signal.signal(signum, old)
        lighthouse.shutdown()
    if stopping:
        how = ("interrupted (Ctrl-C)" if stopping[0] == signal.SIGINT
               else f"stopped by {signal.Signals(stopping[0]).name}")
        print(f"accel-ctx launch: {how}; every replica group was stopped.", file=sys.stderr)
        return 128 + stopping[0]
    failed = [128 - c if c < 0 else c for c in codes if c]  # -9: killed by SIGKILL, 137
    return failed[0] if failed else 0


def _wait(children: list[subprocess.Popen[bytes]], stopping: list[int]) -> list[int]:
    """Each group's exit code, once every group has ended; after a signal, a group that has not
    ended within ``_GRACE_S`` is killed with its workers."""
    codes: dict[int, int] = {}
    stopped_at: float | None = None
    while len(codes) < len(children):
        if stopping and stopped_at is None:
            stopped_at = time.monotonic()
            _signal_all(children, stopping[0])  # one started as the signal came is told too
        if stopped_at is not None and time.monotonic() - stopped_at > _GRACE_S:
            break
        for group, child in enumerate(children):
            code = child.poll()
            if code is not None and group not in codes:
                codes[group] = code
                if code and not stopping:
                    print(f"accel-ctx launch: replica group {group} ended with exit code "
                          f"{code}; the other groups go on.", file=sys.stderr)
        time.sleep(0.2)
    return [codes.get(group, 1) for group in range(len(children))]


def _signal_all(children: list[subprocess.Popen[bytes]], signum: int) -> None:
    for child in children:
        if child.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                os.kill(child.pid, signum)


def _stop(children: list[subprocess.Popen[bytes]]) -> None:
    """Every group's launcher and worker is gone on return: SIGTERM, ``_GRACE_S`` to end (the
    agent stops its workers), then SIGKILL to it and everything it started."""
    _signal_all(children, signal.SIGTERM)
    deadline = time.monotonic() + _GRACE_S
    for child in children:
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for pid in [*_descendants(child.pid), child.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            child.wait()


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux: read from /proc; elsewhere none)."""
    found, todo = [], [pid]
    while todo:
        below = children_of(todo.pop())
        found += below
        todo += below
    return found
