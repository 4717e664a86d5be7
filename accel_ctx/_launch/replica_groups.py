"""``accel-ctx launch --replica-groups R``: a lighthouse and R replica groups on this machine.

Each group is a launcher of its own (``accel-ctx launch`` with the same arguments, one
torchrun agent with its own rendezvous and its own ``--max-restarts``), told its index, the group
count and the lighthouse's address in torchft's variables. The lighthouse (torchft's, in this
process) forms a quorum of the live groups every step. The launcher ends when every group has
ended: 0 when all ended 0, else the first failing group's code.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._job import env as _env
from ..errors import AccelCtxError, ConfigurationError

_NO_TORCHFT = (
    "--replica-groups needs torchft (its lighthouse and Manager): pip install 'accel-ctx[ft]' "
    "(torchft>=0.2), or launch without --replica-groups.")


def wanted(settings: Mapping[str, object], environ: Mapping[str, str]) -> bool:
    """``--replica-groups R`` (R > 1) asked, and this launcher is not one group's already
    (started by :func:`run`, which gives it the group's index)."""
    return int(str(settings.get("replica_groups", 1))) > 1 and not environ.get(
        _env.REPLICA_GROUP_VAR, "")


def start_lighthouse(groups: int) -> Any:
    """torchft's lighthouse on every interface, a port the OS picks, any 1 group a quorum. A
    group that stops beating is dropped after 2 s; a returning group joins within 1 s."""
    try:
        from torchft.coordination import LighthouseServer
    except ImportError as exc:
        raise ConfigurationError(_NO_TORCHFT) from exc
    return LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000,
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
    lighthouse = start_lighthouse(groups)
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
