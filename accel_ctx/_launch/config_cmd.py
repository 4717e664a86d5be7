"""``accel-ctx config``: write launcher defaults to a TOML file, by questions or by flags.

With a terminal and no settings on the command line it asks one question per setting, the
file's current values (else the defaults) in brackets; otherwise it sets the keys given as
flags and keeps the others. ``--show`` prints the settings in force and their files.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError
from . import config as _config

_DEFAULTS: dict[str, Any] = {"nproc": "auto", "nnodes": 1, "node_rank": 0,
                             "mixed_precision": "no", "max_restarts": 0}
_QUESTIONS = {
    "nproc": "Processes per machine (a number, or 'auto' = all local GPUs, else 1)",
    "nnodes": "Machines in the job",
    "master": "Address where the machines meet: HOST:PORT of machine 0",
    "node_rank": "This machine's index (0 = the machine at that address)",
    "mixed_precision": "Mixed precision: no, bf16 or fp16",
    "max_restarts": "Restarts of all workers after one fails",
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="accel-ctx config",
        description="Write launcher defaults to a TOML file. With a terminal and no settings "
        "given, asks questions; otherwise sets the settings given and keeps the others. "
        "Files, highest priority first: --config FILE alone; else ./accel-ctx.toml (searched "
        "up to the project root), then ~/.config/accel-ctx/config.toml ($XDG_CONFIG_HOME). "
        "Flags of `accel-ctx launch` beat every file.",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--config", metavar="FILE", help="this file (default: the user file)")
    where.add_argument("--project", action="store_true",
                       help=f"the project file ./{_config.PROJECT_FILE}")
    p.add_argument("--show", action="store_true", help="print the settings in force and exit")
    p.add_argument("-n", "--nproc", metavar="N", help=_config.KEYS["nproc"])
    p.add_argument("--nnodes", metavar="N", help=_config.KEYS["nnodes"])
    p.add_argument("--node-rank", dest="node_rank", metavar="R", help=_config.KEYS["node_rank"])
    p.add_argument("--master", metavar="HOST:PORT", help=_config.KEYS["master"])
    p.add_argument("--mixed-precision", dest="mixed_precision", metavar="P",
                   help=_config.KEYS["mixed_precision"])
    p.add_argument("--max-restarts", dest="max_restarts", metavar="K",
                   help=_config.KEYS["max_restarts"])
    return p


def config_main(argv: Sequence[str], ask: Callable[[str], str] | None = None) -> int:
    """Run ``accel-ctx config``; ``ask`` replaces ``input`` (None: ask only on a terminal)."""
    options = parser().parse_args(list(argv))
    try:
        if options.show:
            print(_config.show(_config.load(options.config)), end="")
            return 0
        target = _target(options)
        given = {k: getattr(options, k) for k in _config.KEYS if getattr(options, k) is not None}
        current = _config.read_file(target) if target.is_file() else {}
        if given:
            values = {**current, **{k: _config.check(k, v, f"--{k.replace('_', '-')}")
                                    for k, v in given.items()}}
        elif ask is not None or sys.stdin.isatty():
            answered = _interview(current, ask or input)
            if answered is None:
                print("accel-ctx config: stopped; nothing written.", file=sys.stderr)
                return 1
            values = answered
        else:
            raise ConfigurationError(
                "no terminal to ask questions on: give the settings as flags, e.g. "
                "`accel-ctx config -n 4 --mixed-precision bf16` (see --help), or --show."
            )
        _check_nodes(values)
    except ConfigurationError as exc:
        return _config.fail("config", exc)
    _config.write(target, values)
    print(f"wrote {target}")
    print(_config.to_toml(values).split("\n", 2)[2], end="")
    return 0


def _target(options: argparse.Namespace) -> Path:
    if options.config:
        return Path(options.config)
    if options.project:
        return _config.project_file() or Path.cwd() / _config.PROJECT_FILE
    return _config.user_file()


def _check_nodes(values: dict[str, Any]) -> None:
    max_nodes = int(str(values.get("nnodes", 1)).rsplit(":", 1)[-1])
    if values.get("node_rank", 0) >= max_nodes:
        raise ConfigurationError(
            f"node_rank {values['node_rank']} with {max_nodes} machine(s): give a node rank "
            f"from 0 to {max_nodes - 1}."
        )


def _interview(current: dict[str, Any], ask: Callable[[str], str]) -> dict[str, Any] | None:
    """One question per setting; an invalid answer is explained and asked again at once."""
    values: dict[str, Any] = {}
    try:
        for key in ("nproc", "nnodes", "master", "node_rank", "mixed_precision",
                    "max_restarts"):
            if key in ("master", "node_rank") and str(values["nnodes"]) == "1":
                continue  # one machine: nothing to meet at
            default = current.get(key, _DEFAULTS.get(key))
            values[key] = _ask_one(key, default, ask, values)
    except (EOFError, KeyboardInterrupt):
        print()
        return None
    return values


def _ask_one(key: str, default: Any, ask: Callable[[str], str], before: dict[str, Any]) -> Any:
    """Ask until the answer (or the default, on Enter) is valid with the answers ``before``."""
    shown = f" [{default}]" if default is not None else ""
    while True:
        answer = ask(f"{_QUESTIONS[key]}{shown}: ").strip()
        if not answer and default is None:
            print(f"  please answer: {_config.KEYS[key]}")
            continue
        try:
            value = _config.check(key, answer or default, "answer" if answer else "default")
            if key == "node_rank":
                _check_nodes({**before, key: value})
            return value
        except ConfigurationError as exc:
            print(f"  {exc}")
