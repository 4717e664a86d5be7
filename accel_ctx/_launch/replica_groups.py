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
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._job import env as _env
from ..errors import AccelCtxError, ConfigurationError
from .settings import split_host_port

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
    if "lighthouse" in settings or groups > 1:  # a bad one is named before anything starts
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
    on it, silently, for its own timeouts)."""
    if seconds is None:
        seconds = _env.replica_timeout()
    address = str(settings.get("lighthouse") or "")
    host, port = split_host_port(address) or ("", 0)
    if not host:
        return ""
    deadline = time.monotonic() + seconds
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(5.0, seconds)):
                return ""
        except OSError as exc:
            why = exc.strerror or type(exc).__name__
        if time.monotonic() + 1 > deadline:
            break
        time.sleep(1)
    return (f"cannot reach the replica groups' lighthouse at http://{address} within "
            f"{seconds:g} s ({why}). Start `accel-ctx lighthouse --port {port}` on {host} "
            "first, or check --lighthouse (the host and port it printed).")


def start_lighthouse(bind: str = "[::]:0", min_replicas: int = 1,
                     missing: str = _NO_TORCHFT) -> Any:
    """torchft's lighthouse at ``bind`` (every interface, a port the OS picks), any
    ``min_replicas`` groups a quorum. A group that stops beating is dropped after 2 s; a
    returning group joins within 1 s. ``missing``: the error without torchft."""
    try:
        from torchft.coordination import LighthouseServer
    except ImportError as exc:
        raise ConfigurationError(missing) from exc
    return LighthouseServer(bind=bind, min_replicas=min_replicas, join_timeout_ms=1000,
                            quorum_tick_ms=100, heartbeat_timeout_ms=2000)


def run(argv: Sequence[str], groups: int, environ: Mapping[str, str],
        fail: Callable[[str, AccelCtxError], int]) -> int:
    """Start the lighthouse and ``groups`` launchers of ``argv`` (without the flag); wait."""
    try:
        return _run(argv, groups, environ)
    except AccelCtxError as exc:  # torchft missing: one line, exit code 1
        return fail("launch", exc)


def _run(argv: Sequence[str], groups: int, environ: Mapping[str, str]) -> int:
    # torchft's Rust side logs every quorum at INFO; its warnings and errors stay
    os.environ.setdefault("RUST_LOG", "warn")
    lighthouse = start_lighthouse()
    address = lighthouse.address()
    print(f"accel-ctx launch: {groups} replica groups, lighthouse at {address}", file=sys.stderr)
    # each group's launcher gets the same command line: the group index in its environment
    # makes it one group's launcher (see wanted), whatever --replica-groups says
    rest = list(argv)
    children: list[subprocess.Popen[bytes]] = []
    try:
        for group in range(groups):
            env = {**environ, "RUST_LOG": os.environ["RUST_LOG"], _env.LIGHTHOUSE_VAR: address, _env.REPLICA_GROUP_VAR: str(group),
                   _env.REPLICA_GROUPS_VAR: str(groups)}
            children.append(subprocess.Popen(
                [sys.executable, "-m", "accel_ctx.cli", "launch", *rest], env=env))
        return _wait(children)
    except KeyboardInterrupt:
        _stop(children, signal.SIGINT)
        return 128 + signal.SIGINT
    finally:
        _stop(children, signal.SIGTERM)
        lighthouse.shutdown()


def _wait(children: list[subprocess.Popen[bytes]]) -> int:
    forwarded: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        forwarded.append(signum)
        _stop(children, signum)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        codes: dict[int, int] = {}
        while len(codes) < len(children):
            for group, child in enumerate(children):
                code = child.poll()
                if code is not None and group not in codes:
                    codes[group] = code
                    if code:
                        print(f"accel-ctx launch: replica group {group} ended with exit code "
                              f"{code}; the other groups go on.", file=sys.stderr)
            time.sleep(0.2)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if forwarded:
        return 128 + forwarded[0]
    failed = [c for _, c in sorted(codes.items()) if c]
    return failed[0] if failed else 0


def _stop(children: list[subprocess.Popen[bytes]], signum: int) -> None:
    for child in children:
        if child.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                os.kill(child.pid, signum)
    for child in children:
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
