"""The ``accel-ctx`` command: ``accel-ctx launch -n N script.py args...``.

``launch`` runs the script on N processes per node through torchrun's engine
(``torch.distributed.run``); every torchrun flag placed before the script is passed through.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from . import _env

_FRIENDLY = {"-n": "--nproc-per-node", "--nproc": "--nproc-per-node"}


def _torchrun_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    return get_args_parser()


def split_launch_args(argv: Sequence[str]) -> tuple[list[str], dict[str, str], list[str]]:
    """Split ``launch`` arguments into (torchrun flags, our settings, [script, *script args])."""
    parser = _torchrun_parser()
    takes_value = {
        option: action.nargs != 0
        for action in parser._actions
        for option in action.option_strings
    }
    ours: dict[str, str] = {}
    flags: list[str] = []
    i = 0
    args = list(argv)
    while i < len(args):
        token = args[i]
        if token == "--":
            i += 1
            break
        if not token.startswith("-"):
            break
        name, eq, inline = token.partition("=")
        if name in ("--mixed-precision", "--mixed_precision"):
            value = inline if eq else _value(args, i, name)
            ours["mixed_precision"] = value
            i += 1 if eq else 2
            continue
        name = _FRIENDLY.get(name, name)
        if name not in takes_value:
            raise SystemExit(
                f"accel-ctx launch: unknown option {token!r}; options go before the script "
                "(see `accel-ctx launch --help`)."
            )
        if takes_value[name] and not eq:
            flags += [name, _value(args, i, name)]
            i += 2
        else:
            flags.append(f"{name}={inline}" if eq else name)
            i += 1
    rest = args[i:]
    if not rest:
        raise SystemExit("accel-ctx launch: give the script to run, e.g. `accel-ctx launch -n 2 train.py`.")
    return flags, ours, rest


def _value(args: list[str], i: int, name: str) -> str:
    if i + 1 >= len(args):
        raise SystemExit(f"accel-ctx launch: {name} needs a value.")
    return args[i + 1]


_LAUNCH_HELP = """\
usage: accel-ctx launch [-n N] [--mixed-precision {bf16,fp16,no}] [torchrun flags] script.py [args...]

Runs script.py on N processes on this machine through torchrun (torch.distributed.run).
-n/--nproc counts processes PER NODE, as torchrun's --nproc-per-node does (with --nnodes 2,
-n 4 gives 8 processes in all). Every torchrun flag (--nnodes, --rdzv-endpoint,
--max-restarts, ...) works when placed before the script; see `torchrun --help`.
--mixed-precision sets the default of mixed_precision() / distributed() in the script.
"""


def launch_main(argv: Sequence[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_LAUNCH_HELP)
        return 0
    flags, ours, rest = split_launch_args(argv)
    if "mixed_precision" in ours:
        from ._precision import _policy_name

        os.environ[_env.MIXED_PRECISION_VAR] = _policy_name(ours["mixed_precision"])
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main([*flags, *rest])
    except ChildFailedError:
        return 1  # torchrun already printed which rank failed and why
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``accel-ctx`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print("usage: accel-ctx launch [-n N] [torchrun flags] script.py [args...]")
        return 0
    command, rest = args[0], args[1:]
    if command == "launch":
        return launch_main(rest)
    print(f"accel-ctx: unknown command {command!r}; try `accel-ctx launch --help`.", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
