"""The ``accel-ctx`` command: ``launch``, ``lighthouse``, ``config`` and ``env``.

``launch`` runs a script on N processes per node through torchrun's engine
(``torch.distributed.run``, in this process); every torchrun flag placed before the script is
passed through, and everything after the script's name is the script's own: torchrun's parser
never sees it. This module imports only the standard library until it hands over to torchrun.

Examples:
    >>> from accel_ctx.cli import main
    >>> main(["--help"])  # doctest: +ELLIPSIS
    usage: accel-ctx ...
    0
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from .errors import AccelCtxError

USAGE = """\
usage: accel-ctx {launch,lighthouse,config,env} ...

  accel-ctx launch [-n N] [options] script.py [args...]   run a script on N processes per node
  accel-ctx lighthouse [--port P] [--min-replicas N]       where replica groups on many nodes meet
  accel-ctx config [--show] [settings]                     write launcher defaults (TOML)
  accel-ctx env                                            versions, devices, config in force
  accel-ctx --version                                      print the version (also -V)
  accel-ctx --help                                         print this help (also -h)

`accel-ctx COMMAND --help` tells more.
"""

def torchrun_arity() -> dict[str, bool]:
    """torchrun's options and whether each takes a value, read from its own parser."""
    from torch.distributed.run import get_args_parser

    return {
        option: action.nargs != 0
        for action in get_args_parser()._actions
        for option in action.option_strings
    }


def launch_main(argv: Sequence[str]) -> int:
    """Run ``accel-ctx launch``."""
    from pathlib import Path

    from ._job import env as _env
    from ._launch import args as _launch_args
    from ._launch import replica_groups as _replica_groups
    from ._launch import script as _script
    from ._launch.config import fail
    from ._launch.help import launch_help
    from ._launch.netif import route_to

    if not argv:  # nothing to run: a usage error, as for `accel-ctx` alone
        print(launch_help(), end="", file=sys.stderr)
        return 2
    if not _replica_groups.die_with_launcher(os.environ):  # first: nothing may outlive it
        print("accel-ctx launch: the `accel-ctx launch --replica-groups` that started this "
              "replica group ended before it began; nothing was started.", file=sys.stderr)
        return 128 + signal.SIGTERM
    try:
        if _launch_args.wants_help(argv):  # --help imports no torch
            print(launch_help(), end="")
            return 0
        arity = torchrun_arity()
        if _launch_args.parse(argv, arity).help:
            print(launch_help(), end="")
            return 0
        plan = _launch_args.plan(argv, arity, os.environ, route=route_to)
        options = torchrun_options(plan.torchrun_args, len(plan.script) - 1)
        _script.check(options.training_script, module=options.module,
                      no_python=options.no_python, run_path=options.run_path,
                      cwd=Path.cwd(), environ=os.environ)
    except AccelCtxError as exc:
        return fail("launch", exc)
    if plan.network.warning:
        print(f"accel-ctx launch: warning: {plan.network.warning}", file=sys.stderr)
    if "replica_timeout" in plan.settings:  # this launcher, its groups' and their workers
        os.environ[_env.REPLICA_TIMEOUT_VAR] = str(plan.settings["replica_timeout"])
    if _replica_groups.wanted(plan.settings, os.environ):  # a lighthouse, a launcher per group
        return _replica_groups.run(argv, int(plan.settings["replica_groups"]), os.environ, fail,
                                   plan.settings.get("lighthouse_bind"))
    held = master_held(plan.settings.get("master")) or _replica_groups.unreachable(plan.settings)
    if held:
        print(f"accel-ctx launch: {held}", file=sys.stderr)
        return 1
    os.environ.update(plan.env)  # this process is the launcher: the workers inherit them
    if not os.environ.get(_env.LIGHTHOUSE_VAR):
        return run_torchrun(options, plan.settings, plan.network.note)
    return run_replica_group(options, plan.settings, plan.network.note)


def run_replica_group(
    options: argparse.Namespace, settings: dict[str, Any], network_note: str = ""
) -> int:
    """One replica group's launcher: :func:`run_torchrun` as
    :func:`accel_ctx._launch.group_watch.run_group` watches it."""
    from ._launch import group_watch

    return group_watch.run_group(
        lambda group: run_torchrun(options, settings, network_note, group=group),
        _verdict, multi_machine="lighthouse" in settings)


def torchrun_options(args: Sequence[str], script_args: int) -> argparse.Namespace:
    """torchrun's options for ``args`` (its flags, the script, then ``script_args`` arguments of
    the script's own), parsed by torchrun's parser up to the script's name only.

    argparse would read the script's arguments too, and refuse one that begins like a torchrun
    option (``--log`` is ambiguous: ``--log-dir``, ``--logs-specs``); they are the script's.

    Examples:
        >>> from accel_ctx.cli import torchrun_options
        >>> options = torchrun_options(["--nnodes", "1", "train.py", "--log", "x"], 2)
        >>> options.nnodes, options.training_script, options.training_script_args
        ('1', 'train.py', ['--log', 'x'])
    """
    from torch.distributed.run import get_args_parser

    cut = len(args) - script_args
    flags, script = list(args[:cut - 1]), args[cut - 1]
    # "--" keeps a script whose name begins with "-" from reading as an option
    options = get_args_parser().parse_args([*flags, "--", script] if script.startswith("-")
                                           else [*flags, script])
    options.training_script_args = list(args[cut:])
    return options


def master_held(master: Any, seconds: float = 10.0) -> str:
    """Why ``--master HOST:PORT`` cannot be the rendezvous, or ''.

    Something that accepts connections there but does not answer as a rendezvous store (another
    program's port) would keep torchrun's store client waiting, silently, for ten minutes; it
    is found here within ``seconds``. Nothing listening is fine: node 0 has not started yet.
    """
    from ._group.probe import OTHER, what_answers
    from ._launch.settings import split_host_port

    address = split_host_port(str(master)) if master else None
    if address is None or what_answers(*address, seconds) != OTHER:
        return ""
    host, port = address
    return (f"the rendezvous address --master {master} is taken: something accepts "
            f"connections at {host}:{port} but does not answer as a rendezvous store within "
            f"{seconds:g} s, so the port is most likely held by another program. Free the "
            "port, or give --master another one (the same on every node).")


def run_torchrun(
    options: argparse.Namespace, settings: dict[str, Any], network_note: str = "",
    group: int | None = None,
) -> int:
    """Hand torchrun's ``options`` (:func:`torchrun_options`) to torchrun; turn its failures
    into one clear message and an exit code.

    The exit code is the script's own (that of the rank that failed first; 128 + N for a rank
    killed by signal N); a launcher stopped by a signal (Ctrl-C) exits with 128 + N after one
    line, as a shell does. ``network_note`` (several nodes: the addresses this node tried)
    follows a failure. A replica ``group``'s launcher said its failure already (each as it
    happened, ``group_watch.failure_line``): torchrun's table is not printed again.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import run

    from ._launch.signals import forward_sigusr1, quiet_signal_shutdown

    try:
        with quiet_signal_shutdown(), forward_sigusr1():
            record(run)(options)  # what torchrun's main() does once it has parsed its options
    except SignalException as exc:
        return interrupted(int(exc.sigval))
    except KeyboardInterrupt:  # Ctrl-C before torchrun's own handler was installed
        return interrupted(signal.SIGINT)
    except ChildFailedError as exc:
        if group is not None:
            return failure_exit_code(exc)
        print(describe_failure(exc, settings.get("max_restarts", 0)), file=sys.stderr)
        if network_note:
            print(f"accel-ctx launch: if the failure is ranks not reaching each other:"
                  f"{network_note}", file=sys.stderr)
        return failure_exit_code(exc)
    except RendezvousError as exc:
        where = options.rdzv_endpoint or "?"
        detail = f": {exc}" if str(exc) else ""
        if type(exc).__name__ == "RendezvousConnectionError":
            print(f"accel-ctx launch: cannot connect to the rendezvous at {where} "
                  f"({exc}). Start node 0 (the --master host) first, with the same --master; "
                  f"check that this machine reaches that address and port.{network_note}",
                  file=sys.stderr)
            return 1
        print(
            f"accel-ctx launch: the rendezvous at {where} did not complete with "
            f"{settings.get('nnodes', 1)} node(s) ({type(exc).__name__}{detail}). Start the "
            "same command on every node, with the same --master and --nnodes and its own "
            "--node-rank; how long the nodes wait for each other is `--rdzv-conf "
            f"join_timeout=SECONDS` (default 600).{network_note}",
            file=sys.stderr,
        )
        return 1
    return 0


def interrupted(signum: int) -> int:
    """One line for a launcher stopped by a signal; the shell's exit code for it (130: Ctrl-C)."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    how = "interrupted (Ctrl-C)" if signum == signal.SIGINT else f"stopped by {name}"
    print(f"accel-ctx launch: {how}; every worker was stopped.", file=sys.stderr)
    return 128 + signum


def failure_exit_code(exc: Any) -> int:
    """The job's exit code: that of the rank that caused the failure (see ``_verdict``), its
    own or 128 + N if signal N killed it."""
    return _verdict(exc)[3]


def _code(exitcode: int) -> int:
    if exitcode < 0:
        return 128 + min(-exitcode, 127)
    return exitcode if 0 < exitcode < 256 else 1


def _verdict(exc: Any) -> tuple[int, Any, tuple[int, str] | None, int]:
    """(the rank that caused the failure, its failure or None, (the rank that named it, its
    message) or None, the exit code).

    The culprit is the rank our ranks' error files name most (``_group.blame``); else the rank that
    failed first by itself (not one the launcher stopped with SIGTERM because another had
    failed). The exit code is the culprit's own, unless the launcher stopped it or it left
    with 0 (``os._exit(0)``): then the code of the rank that named it.
    """
    from ._group.blame import culprit_of

    failures: dict[int, Any] = dict(getattr(exc, "failures", None) or {})
    named: dict[int, list[tuple[int, str]]] = {}
    for rank, failed in sorted(failures.items()):
        blame = culprit_of(getattr(failed, "error_file_data", None))
        if blame is not None:
            named.setdefault(blame[0], []).append((rank, blame[1]))
    if named:
        culprit = max(sorted(named), key=lambda r: len(named[r]))  # ties: the lowest rank
        namers = sorted(named[culprit], key=lambda n: n[0] == culprit)  # another rank first
        failure = failures.get(culprit)
        namer = failures[namers[0][0]]
        code = namer.exitcode
        if failure is not None and failure.exitcode != 0 and not (
                failure.exitcode == -signal.SIGTERM and namer.exitcode > 0):
            code = failure.exitcode  # its own: not stopped by the launcher, not a clean exit
        return culprit, failure, namers[0], _code(code)
    by_itself = {r: f for r, f in failures.items() if f.exitcode != -signal.SIGTERM}
    if by_itself:
        rank = min(by_itself, key=lambda r: (by_itself[r].timestamp, r))
        failure = by_itself[rank]
    else:
        rank, failure = exc.get_first_failure()
    return rank, failure, None, _code(int(failure.exitcode))


def describe_failure(exc: Any, max_restarts: int) -> str:
    """torchrun's failure table, then one line naming the rank that caused the failure and
    why (see ``_verdict``)."""
    rank, failure, namer, _ = _verdict(exc)
    if namer is not None:
        by, message = namer
        if by != rank:
            return (
                f"{exc.format_msg()}\naccel-ctx launch: rank {rank} caused the failure "
                f"(named by rank {by}, which exited with code "
                f"{exc.failures[by].exitcode}): {message}\nThe job stopped every rank."
            )
        return (f"{exc.format_msg()}\naccel-ctx launch: rank {rank} caused the failure: "
                f"{message}\nThe job stopped every rank.")
    if failure.exitcode < 0:
        how = f"was killed by signal {failure.signal_name()}"
    else:
        how = f"exited with code {failure.exitcode} (its output is above)"
    # a restart helps a rank that was killed (a signal, or the 128 + N that resumable()'s
    # preemption exits with), not a script that chose its exit code (sys.exit(3)) or raised
    retry = (
        f" after {max_restarts} restart(s)" if max_restarts
        else "; add --max-restarts K to restart the workers after a crash"
        if failure.exitcode < 0 or failure.exitcode > 128 else ""
    )
    return (
        f"{exc.format_msg()}\naccel-ctx launch: rank {rank} (local rank {failure.local_rank}, "
        f"pid {failure.pid}) {how}; the job stopped every rank{retry}."
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``accel-ctx`` console script; returns the exit code.

    Examples:
        >>> from accel_ctx.cli import main
        >>> main(["env", "--help"])  # doctest: +ELLIPSIS
        usage: accel-ctx env
        ...
        0
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:  # no command: the help, as a usage error
        print(USAGE, end="", file=sys.stderr)
        return 2
    if args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0
    command, rest = args[0], args[1:]
    if command == "launch":
        try:
            return launch_main(rest)
        except KeyboardInterrupt:  # Ctrl-C while torch was still loading
            return interrupted(signal.SIGINT)
    if command in ("lighthouse", "config"):  # the launcher wing's other commands (no torch)
        from ._launch.config_cmd import config_main
        from ._launch.lighthouse import lighthouse_main

        return (lighthouse_main if command == "lighthouse" else config_main)(rest)
    if command == "env":
        from . import __version__
        from ._launch.envinfo import env_main

        return env_main(rest, __version__)
    if command in ("--version", "-V"):
        from . import __version__

        print(f"accel-ctx {__version__}")
        return 0
    print(f"accel-ctx: unknown command {command!r}; try `accel-ctx --help`.", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
