"""``accel-ctx lighthouse``: the replica groups' meeting point, for groups on several machines.

torchft's lighthouse (its Rust server, in this process) forms a quorum of the live groups every
step. It runs in the foreground until SIGINT or SIGTERM, then exits 0; the groups are started
elsewhere with ``accel-ctx launch --lighthouse HOST:PORT --replica-group I`` (see
:mod:`.replica_groups`, which starts one itself for groups on one machine, with the same
timeouts).

Examples:
    >>> from accel_ctx._launch.lighthouse import parser
    >>> options = parser().parse_args(["--min-replicas", "2"])
    >>> options.min_replicas, options.port, options.bind  # bind: the config's, else [::]
    (2, 29510, None)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Sequence

from ..errors import AccelCtxError, ConfigurationError
from .config import fail, load
from .replica_groups import FT_INSTALL, WILDCARDS, bracketed, start_lighthouse

DEFAULT_PORT = 29510
"""Beside torchrun's 29500, as the groups' own rendezvous ports are (one machine: any)."""
_NO_TORCHFT = (f"the lighthouse is torchft's: {FT_INSTALL} on this machine, then run "
               "`accel-ctx lighthouse` again.")


def parser() -> argparse.ArgumentParser:
    """The parser of ``accel-ctx lighthouse``."""
    p = argparse.ArgumentParser(
        prog="accel-ctx lighthouse",
        description="Run the lighthouse that fault-tolerant replica groups on several machines "
        "meet at (torchft's), in the foreground until Ctrl-C or SIGTERM. Start each group's "
        "launcher with `accel-ctx launch -n P --lighthouse HOST:PORT --replica-group I "
        "--replica-groups R script.py`, HOST:PORT as this command prints it. Needs "
        "torchft (accel_ctx's ft extra).")
    p.add_argument("--min-replicas", type=int, default=1, metavar="N",
                   help="groups that must be alive for a step to be taken (default 1: the "
                   "last group alive trains alone)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, metavar="P",
                   help=f"the port to listen on (default {DEFAULT_PORT}; 0: one the OS picks)")
    p.add_argument("--bind", default=None, metavar="ADDR",
                   help="the address to listen on (default: lighthouse_bind in the config "
                   "files, else [::]: every interface)")
    return p


def lighthouse_main(argv: Sequence[str]) -> int:
    """Run ``accel-ctx lighthouse``; 0 once stopped by SIGINT or SIGTERM."""
    options = parser().parse_args(list(argv))
    try:
        if options.min_replicas < 1 or not 0 <= options.port < 65536:
            raise ConfigurationError(
                f"--min-replicas {options.min_replicas} --port {options.port}: give "
                "--min-replicas 1 or more and a port from 0 to 65535.")
        bind = options.bind
        if bind is None:  # the config files' lighthouse_bind (`accel-ctx config`), else all
            bind = str(load(environ=os.environ).values.get("lighthouse_bind", "[::]"))
        host = bracketed(bind)
        # torchft's Rust side logs every quorum at INFO; its warnings and errors stay
        os.environ.setdefault("RUST_LOG", "warn")
        try:
            server = start_lighthouse(f"{host}:{options.port}", options.min_replicas,
                                      missing=_NO_TORCHFT)
        except RuntimeError as exc:  # the port is taken, or the address is not this machine's
            raise ConfigurationError(
                f"cannot listen on {host}:{options.port} ({exc}): give another --port, or a "
                "--bind address of this machine.") from exc
    except AccelCtxError as exc:
        return fail("lighthouse", exc)
    address = server.address()  # http://<this host's name>:<port>
    if host not in WILDCARDS:  # listening on one address: the groups must dial that one
        address = f"http://{host}:{address.rsplit(':', 1)[1]}"
    print(f"accel-ctx lighthouse: listening at {address}; start each replica group with "
          f"`accel-ctx launch --lighthouse {address} --replica-group I ...` (a quorum needs "
          f"{options.min_replicas} group(s); Ctrl-C stops it)", flush=True)
    stopped = _wait_for_signal()
    server.shutdown()
    print(f"accel-ctx lighthouse: stopped by {signal.Signals(stopped).name}.", file=sys.stderr)
    return 0


def _wait_for_signal() -> int:
    """Block until SIGINT or SIGTERM; return which."""
    got: list[int] = []
    done = threading.Event()

    def handler(signum: int, _frame: object) -> None:
        got.append(signum)
        done.set()

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not done.wait(0.5):  # a timed wait: the handlers run between waits
            pass
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
    return got[0]
