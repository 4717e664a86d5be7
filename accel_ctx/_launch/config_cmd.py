"""``accel-ctx config``: write launcher defaults to a TOML file, by questions or by flags.

With a terminal and no settings on the command line it asks one question per setting (in the
order of the settings table), the file's current values (else the defaults) in brackets; otherwise it sets the keys given as
flags and keeps the others. ``--show`` prints the settings in force and their files.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from ..errors import ConfigurationError
from . import config as _config
from .settings import SETTINGS, Setting, Value, check


def parser() -> argparse.ArgumentParser:
    """The parser of ``accel-ctx config``: where to write, then one flag per setting."""
    p = argparse.ArgumentParser(
        prog="accel-ctx config",
        description="Write launcher defaults to a TOML file. With a terminal and no settings "
        "given, asks questions; otherwise sets the settings given and keeps the others. "
        f"{_config.precedence()}",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--config", metavar="FILE", help="this file (default: the user file)")
    where.add_argument("--project", action="store_true",
                       help=f"the project file ./{_config.PROJECT_FILE}")
    p.add_argument("--show", action="store_true", help="print the settings in force and exit")
    for s in SETTINGS:
        p.add_argument(*s.flags, dest=s.key, metavar=s.metavar, help=s.meaning)
    return p


def config_main(argv: Sequence[str], ask: Callable[[str], str] | None = None) -> int:
    """Run ``accel-ctx config``; ``ask`` replaces ``input`` (None: ask only on a terminal)."""
    options = parser().parse_args(list(argv))
    try:
        if options.show:
            print(_config.show(_config.load(options.config)), end="")
            return 0
        target = _target(options)
        current = _config.read_file(target) if target.is_file() else {}
        given = {s.key: check(s.key, getattr(options, s.key), s.flag)
                 for s in SETTINGS if getattr(options, s.key) is not None}
        if given:
            values = {**current, **given}
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


def _check_nodes(values: dict[str, Value]) -> None:
    max_nodes = int(str(values.get("nnodes", 1)).rsplit(":", 1)[-1])
    if int(values.get("node_rank", 0)) >= max_nodes:
        raise ConfigurationError(
            f"node_rank {values['node_rank']} with {max_nodes} machine(s): give a node rank "
            f"from 0 to {max_nodes - 1}."
        )


def _interview(current: dict[str, Value], ask: Callable[[str], str]) -> dict[str, Value] | None:
    """One question per setting; an invalid answer is explained and asked again at once."""
    values: dict[str, Value] = {}
    try:
        for s in SETTINGS:
            if not s.asked:  # one launcher's own (its replica group): kept as it was
                if s.key in current:
                    values[s.key] = current[s.key]
                continue
            if s.several_nodes_only and str(values.get("nnodes", 1)) == "1":
                continue  # one machine: nothing to meet at
            values[s.key] = _ask_one(s, current.get(s.key, s.default), ask, values)
    except (EOFError, KeyboardInterrupt):
        print()
        return None
    return values


def _ask_one(
    s: Setting, default: Value | None, ask: Callable[[str], str], before: dict[str, Value]
) -> Value:
    """Ask until the answer (or the default, on Enter) is valid with the answers ``before``."""
    shown = f" [{default}]" if default is not None else ""
    while True:
        answer = ask(f"{s.question}{shown}: ").strip()
        if not answer and default is None:
            print(f"  please answer: {s.meaning}")
            continue
        try:
            value = check(s.key, answer or default, "answer" if answer else "default")
            if s.key == "node_rank":
                _check_nodes({**before, s.key: value})
            return value
        except ConfigurationError as exc:
            print(f"  {exc}")
