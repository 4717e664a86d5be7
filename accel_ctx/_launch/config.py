"""Launcher defaults kept in TOML files: where they live, how they merge, how they are checked.

Where each setting comes from is :data:`PRECEDENCE`, the one statement of the rule in code:
both ``--help`` texts print it, ``args._resolve`` applies it (a file given with ``--config``
replaces the project and user files, it is not layered over them: see :func:`load`).

A file holds flat keys, the settings of :mod:`.settings`, each checked there, e.g.::

    nproc = 4
    mixed_precision = "bf16"
    max_restarts = 1

Reading uses the standard library's ``tomllib``; writing uses the tiny writer below (flat keys
of strings and integers need no TOML library), through a temporary file and an atomic rename.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError
from .settings import KEYS, Value, check

PROJECT_FILE = "accel-ctx.toml"
PRECEDENCE = (
    "the flags on the accel-ctx launch command line",
    "under srun with one launcher per node, SLURM's node count, node index and first node "
    "(--nnodes, --node-rank, --master)",
    "the file given with --config FILE, which replaces the next two: they are not read",
    f"the project file ./{PROJECT_FILE} (the nearest, up to the project root)",
    "the user file ~/.config/accel-ctx/config.toml ($XDG_CONFIG_HOME)",
    "the built-in defaults",
)
"""Where each launcher setting comes from, on its own, highest priority first. README.md says
it at length (section "Where the launcher's settings come from"), in the same order."""


def precedence() -> str:
    """:data:`PRECEDENCE` as the sentence both ``--help`` texts print.

    Examples:
        >>> from accel_ctx._launch.config import precedence
        >>> print(precedence())  # doctest: +ELLIPSIS
        Each setting comes, on its own, from the first of: (1) the flags on the accel-ctx ...
    """
    return ("Each setting comes, on its own, from the first of: "
            + "; ".join(f"({i}) {level}" for i, level in enumerate(PRECEDENCE, 1)) + ".")


@dataclass
class Config:
    """Settings read from the config files, and the file each one came from."""

    values: dict[str, Value] = field(default_factory=dict)
    """Each setting found, in canonical form."""
    sources: dict[str, str] = field(default_factory=dict)
    """The file each setting came from."""
    files: list[Path] = field(default_factory=list)
    """The files read, lowest priority first."""


def user_file(environ: Mapping[str, str] | None = None) -> Path:
    """The per-user file: ``$XDG_CONFIG_HOME/accel-ctx/config.toml`` (``~/.config/...``)."""
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "accel-ctx" / "config.toml"


def project_file(cwd: Path | None = None) -> Path | None:
    """The nearest ``accel-ctx.toml`` from ``cwd`` up to the project root, or None."""
    here = (cwd or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        candidate = folder / PROJECT_FILE
        if candidate.is_file():
            return candidate
        if (folder / ".git").exists() or (folder / "pyproject.toml").is_file():
            return None  # the project root: files above it belong to someone else
    return None


def load(
    explicit: str | os.PathLike[str] | None = None,
    cwd: Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Read the settings in force: ``explicit`` alone, else the project file over the user file.

    A file named on the command line replaces the files found by themselves, as
    ``accelerate launch --config_file`` does: a job started with ``--config cluster.toml``
    then runs the same whoever starts it, whatever their own user file says.
    """
    config = Config()
    if explicit is not None:
        path = Path(explicit)
        if not path.is_file():
            raise ConfigurationError(
                f"config file {str(path)!r} does not exist; create it with "
                f"`accel-ctx config --config {path}` or give an existing file."
            )
        layers = [path]
    else:
        layers = [p for p in (user_file(environ), project_file(cwd)) if p is not None]
    for path in layers:  # lowest priority first: later files override earlier ones
        if path.is_file():
            for key, value in read_file(path).items():
                config.values[key] = value
                config.sources[key] = str(path)
            config.files.append(path)
    return config


def read_file(path: Path) -> dict[str, Value]:
    """Parse and check one config file (every key and value, by :func:`.settings.check`)."""
    toml = _toml_reader()
    try:
        with path.open("rb") as f:
            raw = toml.load(f)
    except (OSError, toml.TOMLDecodeError) as exc:
        raise ConfigurationError(
            f"config file {str(path)!r} cannot be read ({exc}); fix it or rewrite it with "
            "`accel-ctx config`."
        ) from exc
    return {key: check(key, value, f"{path}: {key}") for key, value in raw.items()}


def _toml_reader() -> Any:
    # tomllib is in the standard library from Python 3.11; tomli is the same reader for 3.10.
    import importlib

    for name in ("tomllib", "tomli"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ConfigurationError(
        "reading accel-ctx config files needs Python 3.11 or later, or `pip install tomli`."
    )


def to_toml(values: Mapping[str, Value]) -> str:
    """Flat keys of strings and integers as TOML, in the order of the settings table.

    Examples:
        >>> from accel_ctx._launch.config import to_toml
        >>> print(to_toml({"mixed_precision": "bf16", "nproc": 4}), end="")
        # accel-ctx launcher defaults; see `accel-ctx config --help`.
        <BLANKLINE>
        nproc = 4
        mixed_precision = "bf16"
    """
    lines = ["# accel-ctx launcher defaults; see `accel-ctx config --help`.", ""]
    lines += [f"{key} = {toml_value(values[key])}" for key in KEYS if key in values]
    return "\n".join(lines) + "\n"


def toml_value(value: Value) -> str:
    """One value as TOML."""
    # A JSON string literal is a valid TOML basic string (same escapes, \uXXXX included).
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value) if isinstance(value, int) else json.dumps(str(value))


def write(path: Path, values: Mapping[str, Value]) -> None:
    """Write ``values`` to ``path`` atomically: a crash never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(to_toml(values), encoding="utf-8")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def show(config: Config) -> str:
    """The settings in force and where each comes from, for ``--show`` and ``accel-ctx env``."""
    if not config.files:
        return "no config file (defaults: nproc = auto, one node)\n"
    lines = [f"files: {', '.join(str(f) for f in config.files)}"]
    lines += [
        f"{key} = {toml_value(config.values[key])}    # {config.sources[key]}"
        for key in KEYS
        if key in config.values
    ]
    return "\n".join(lines) + "\n"


def fail(command: str, exc: Exception) -> int:
    """Print a user mistake as one line (no traceback) and return the usage exit code."""
    print(f"accel-ctx {command}: {exc}", file=sys.stderr)
    return 2
