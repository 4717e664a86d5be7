"""Is there something to run? ``accel-ctx launch`` asks before torchrun starts anything.

A script that is not there would otherwise start every worker, fail in each, and end in
torchrun's failure table with advice about restarts. Each way torchrun runs the target is
checked as the worker will see it, and only where the answer is certain:

* a file (the default, and ``--run-path``): it exists; a folder only if it holds
  ``__main__.py`` (``python FOLDER`` runs that);
* ``-m NAME``: the module is found from the current folder, on the Python path or by the
  interpreter's own finders (editable installs), each part of a dotted name looked up without
  importing anything (nothing of the user's runs in the launcher). Below a package whose
  ``__init__.py`` touches ``__path__`` (it may add folders at import) nothing is refused; with
  ``PYTHON_EXEC`` the workers run another interpreter, so nothing is checked;
* ``--no-python COMMAND``: an executable file, or a command found on ``PATH``.

Examples:
    >>> from pathlib import Path
    >>> from accel_ctx._launch.script import problem
    >>> problem("no_such_script.py", "file", Path("/"), {})  # doctest: +ELLIPSIS
    "script 'no_such_script.py' does not exist in /; give the path of the script to run ..."
    >>> problem("json.tool", "module", Path("/"), {})
    ''
"""

from __future__ import annotations

import difflib
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from importlib.machinery import ModuleSpec, PathFinder
from pathlib import Path

from ..errors import ConfigurationError

_WHERE = "options of accel-ctx and torchrun go before the script, the script's own after it"


def problem(
    target: str,
    how: str,
    cwd: Path,
    environ: Mapping[str, str],
    path: Sequence[str] | None = None,
) -> str:
    """Why ``target`` cannot run as ``how`` says ('file', 'module' or 'command'), or ''.

    ``cwd`` is the workers' folder; ``path`` the Python path besides it (default ``sys.path``).
    """
    if how == "module":
        return _module(target, cwd, environ, sys.path if path is None else path)
    if how == "command":
        return _command(target, cwd, environ)
    return _file(target, cwd)


def _file(target: str, cwd: Path) -> str:
    where = cwd / target
    if where.is_file():
        return ""
    if where.is_dir():
        if (where / "__main__.py").is_file():
            return ""
        return (f"{target!r} is a folder without __main__.py, not a script: give the Python "
                "file to run, or -m NAME for a module.")
    hint = _close(Path(target).name, where.parent)
    return (f"script {target!r} does not exist in {where.parent}{hint}; give the path of the "
            f"script to run ({_WHERE}).")


def _close(name: str, folder: Path) -> str:
    try:
        names = [p.name for p in folder.iterdir() if p.is_file()]
    except OSError:
        return ""
    close = difflib.get_close_matches(name, names, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _module(name: str, cwd: Path, environ: Mapping[str, str], path: Sequence[str]) -> str:
    if environ.get("PYTHON_EXEC"):
        return ""  # the workers' interpreter has its own path: nothing here is certain
    search = [str(cwd), *(str(cwd / p) if p else str(cwd) for p in path)]  # python -m: cwd first
    try:
        return _walk(name, cwd, search)
    except Exception:  # a finder that fails here may work in the worker: refuse nothing
        return ""


def _walk(name: str, cwd: Path, search: list[str]) -> str:
    """Each part of a dotted name in the package before it, found without importing."""
    parts = name.split(".")
    for depth, part in enumerate(parts):
        spec = _find(part, search, top=depth == 0)
        if spec is None:
            return (f"module {'.'.join(parts[:depth + 1])!r} is not found in {cwd} nor on the "
                    f"Python path, so `python -m {name}` would fail in every worker; give a "
                    f"module found there, or the path of a file without -m ({_WHERE}).")
        if depth == len(parts) - 1:
            return _runnable(name, spec)
        if spec.submodule_search_locations is None:
            return (f"{'.'.join(parts[:depth + 1])!r} is a module, not a package, so it has no "
                    f"module {'.'.join(parts[:depth + 2])!r}; give the module to run with -m.")
        if _extends_its_path(spec):
            return ""  # its __init__ may add folders to __path__ when imported
        search = list(spec.submodule_search_locations)
    return ""


def _runnable(name: str, spec: ModuleSpec) -> str:
    """'' for a module; a package runs its ``__main__`` (``python -m pkg``)."""
    if spec.submodule_search_locations is None or _extends_its_path(spec):
        return ""
    if PathFinder.find_spec("__main__", list(spec.submodule_search_locations)) is not None:
        return ""
    return (f"{name!r} is a package without __main__.py, so `python -m {name}` cannot run it; "
            f"give a module in it (-m {name}.NAME), or add __main__.py to it.")


def _find(part: str, search: list[str], top: bool) -> ModuleSpec | None:
    """The spec of ``part`` in the folders ``search``. A top-level name goes through the
    interpreter's finders in their order (built-in and frozen modules first, editable installs),
    the path finder searching ``search``; their ``find_spec`` imports nothing for such a name."""
    if not top:
        return PathFinder.find_spec(part, search)
    for finder in sys.meta_path:
        if finder is PathFinder:
            spec = PathFinder.find_spec(part, search)
        else:
            find = getattr(finder, "find_spec", None)
            spec = find(part, None) if find is not None else None
        if spec is not None:
            return spec
    return None


def _extends_its_path(spec: ModuleSpec) -> bool:
    if not spec.origin or not spec.has_location:
        return False  # a namespace package: its __path__ is what was found
    try:
        return "__path__" in Path(spec.origin).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return True


def _command(target: str, cwd: Path, environ: Mapping[str, str]) -> str:
    if os.sep in target or (os.altsep and os.altsep in target):
        where = cwd / target
        if where.is_file() and os.access(where, os.X_OK):
            return ""
        if where.is_file():
            return (f"{target!r} is not executable; make it so (`chmod +x {target}`), or drop "
                    "--no-python to run it with Python.")
        return f"command {target!r} does not exist ({_WHERE})."
    if shutil.which(target, path=environ.get("PATH", os.defpath)):
        return ""
    return (f"command {target!r} is not found on PATH; give its path (./{target} for one in "
            f"this folder), or drop --no-python to run a Python script ({_WHERE}).")


def check(
    target: str,
    *,
    module: bool,
    no_python: bool,
    run_path: bool,
    cwd: Path,
    environ: Mapping[str, str],
) -> None:
    """Raise ConfigurationError when ``target`` cannot run the way torchrun's options say."""
    if run_path:  # torchrun: --run-path wins over --no-python
        how = "file"
    elif no_python and module:
        raise ConfigurationError(
            "-m/--module runs a Python module and --no-python runs a command without Python; "
            "keep one of them."
        )
    else:
        how = "command" if no_python else "module" if module else "file"
    found = problem(target, how, cwd, environ)
    if found:
        raise ConfigurationError(found)
