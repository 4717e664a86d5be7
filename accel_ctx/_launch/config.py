"""Launcher defaults kept in TOML files: where they live, how they merge, how they are checked.

Precedence, highest first (each key on its own):

1. flags on the ``accel-ctx launch`` command line;
2. with ``--config FILE``: that file, and no other file;
3. otherwise the project file ``accel-ctx.toml``: the first one found from the current
   directory upwards, stopping at the project root (a folder holding ``.git`` or
   ``pyproject.toml``);
4. then the user file ``$XDG_CONFIG_HOME/accel-ctx/config.toml`` (``~/.config/...``);
5. built-in defaults: ``nproc = "auto"`` (all local GPUs, else 1), one node.

A file holds flat keys, e.g.::

    nproc = 4
    mixed_precision = "bf16"
    max_restarts = 1

Reading uses the standard library's ``tomllib``; writing uses the tiny writer below (flat keys
of strings and integers need no TOML library), through a temporary file and an atomic rename.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError

PROJECT_FILE = "accel-ctx.toml"

# key -> what it means (used in errors, in `accel-ctx config` questions and in --show).
KEYS: dict[str, str] = {
    "nproc": "processes per node: a number, or 'auto' (all local GPUs, else 1)",
    "nnodes": "machines in the job (or MIN:MAX for an elastic job)",
    "node_rank": "this machine's index; node 0 hosts the rendezvous at `master`",
    "master": "HOST:PORT where the nodes meet (node 0's address), for several machines",
    "mixed_precision": "default of mixed_precision() / distributed(): 'no', 'bf16' or 'fp16'",
    "max_restarts": "times all workers restart after one fails (0: the job ends)",
}
_POLICIES = {"no": "no", "fp32": "no", "none": "no", "bf16": "bf16", "bfloat16": "bf16",
             "fp16": "fp16", "float16": "fp16", "half": "fp16"}


@dataclass
class Config:
    """Settings read from the config files, and the file each one came from."""

    values: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)


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
    """Read the settings in force: ``explicit`` alone, else the project file over the user file."""
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


def read_file(path: Path) -> dict[str, Any]:
    """Parse and check one config file."""
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


def check(key: str, value: Any, where: str) -> Any:
    """Validate one setting (from a file or a flag) and return it in canonical form."""
    if key not in KEYS:
        close = difflib.get_close_matches(key, KEYS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigurationError(
            f"{where}: unknown setting {key!r}.{hint} Known settings: {', '.join(KEYS)}."
        )
    if isinstance(value, str):
        value = value.strip()
    given = value  # the value as the user wrote it: errors quote it, never a half-parsed one
    problem = ""
    if key == "nproc":
        if value == "auto":
            return value
        number = _as_int(value)
        if number is None or number < 1:
            problem = "give a number of processes per node (1 or more) or 'auto'"
        value = number
    elif key == "nnodes":
        match = re.fullmatch(r"(\d+)(?::(\d+))?", str(value)) if not isinstance(value, bool) else None
        low, high = (int(match.group(1)), int(match.group(2) or match.group(1))) if match else (0, 0)
        if low < 1 or high < low:
            problem = "give a number of machines (1 or more), or MIN:MAX with 1 <= MIN <= MAX"
        else:
            value = low if low == high and match and match.group(2) is None else f"{low}:{high}"
    elif key in ("node_rank", "max_restarts"):
        number = _as_int(value)
        if number is None or number < 0:
            problem = "give a whole number, 0 or more"
        value = number
    elif key == "master":
        if not isinstance(value, str) or split_host_port(value) is None:
            problem = "give HOST:PORT, e.g. node0.cluster:29500 or [fe80::1]:29500"
    elif key == "mixed_precision":
        name = _POLICIES.get(str(value).lower()) if isinstance(value, str) else None
        if name is None:
            problem = "give 'no', 'bf16' or 'fp16'"
        value = name
    if problem:
        raise ConfigurationError(f"{where}: {given!r} is not valid ({KEYS[key]}); {problem}.")
    return value


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and re.fullmatch(r"\d+", value):
        return int(value)
    return None


def split_host_port(text: str) -> tuple[str, int] | None:
    """``"host:29500"`` -> ``("host", 29500)``; IPv6 in brackets; None if malformed.

    Example:
        >>> split_host_port("[::1]:29500"), split_host_port("node0:80"), split_host_port("x")
        (('::1', 29500), ('node0', 80), None)
    """
    match = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d+)|([^\s:\[\]]+):(\d+)", text.strip())
    if match is None:
        return None
    host = match.group(1) or match.group(3)
    port = int(match.group(2) or match.group(4))
    return (host, port) if 0 < port < 65536 else None


def to_toml(values: Mapping[str, Any]) -> str:
    """Flat keys of strings and integers as TOML, in the order of :data:`KEYS`."""
    lines = ["# accel-ctx launcher defaults; see `accel-ctx config --help`.", ""]
    lines += [f"{key} = {toml_value(values[key])}" for key in KEYS if key in values]
    return "\n".join(lines) + "\n"


def toml_value(value: Any) -> str:
    # A JSON string literal is a valid TOML basic string (same escapes, \uXXXX included).
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value) if isinstance(value, int) else json.dumps(str(value))


def write(path: Path, values: Mapping[str, Any]) -> None:
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
