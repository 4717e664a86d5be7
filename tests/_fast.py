"""The fast tier (`./dev test --fast`, `pytest --fast`): the tests that start no process.

Starting a rank or a launcher costs seconds (a fresh interpreter imports torch), so the inner
loop leaves those tests out. Nothing is marked by hand: at collection, :func:`starts_processes`
reads the code of a test, of its fixtures, and of the functions of the test suite they call
(followed through each function's globals, module attributes included), and a test that reaches
tests/_spawn.py, tests/_launcher.py, subprocess, multiprocessing or accel_ctx's launcher gets
the ``spawns`` marker. A test this reading misses can carry ``@pytest.mark.spawns`` itself;
under ``--fast`` :func:`guard` makes a test that starts a Python process fail at that call,
naming the marker, so the tier stays fast as tests are added.
"""

from __future__ import annotations

import builtins
import multiprocessing.process
import os
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

MARKER = "spawns"
# What starts a process: these names of these modules (a submodule counts as its package).
STARTERS = {
    "subprocess": {"Popen", "run", "call", "check_call", "check_output", "getoutput",
                   "getstatusoutput"},
    "os": {"fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp", "spawnv",
           "spawnve", "spawnl", "spawnle", "execv", "execve", "execl"},
    "multiprocessing": {"Process", "Pool", "get_context", "Manager", "SpawnProcess",
                        "ForkServerProcess", "ForkProcess"},
    "torch.multiprocessing": {"spawn", "start_processes", "Process"},
    "concurrent.futures": {"ProcessPoolExecutor"},
    "accel_ctx": {"launch"},  # accel_ctx.launch(fn): one process per rank
}
_OURS = "tests"  # the functions followed: the suite's own


def _starter(module: str, names: set[str]) -> bool:
    return any((module == m or module.startswith(m + ".")) and not starts.isdisjoint(names)
               for m, starts in STARTERS.items())


def _names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def _reaches_a_starter(fn: Callable[..., Any], seen: set[int]) -> bool:
    fn = getattr(fn, "__wrapped__", fn)
    code = getattr(fn, "__code__", None)
    if code is None or id(code) in seen:
        return False
    seen.add(id(code))
    scope = getattr(fn, "__globals__", {})
    names = set(_names(code))
    package = str(scope.get("__name__", "")).rpartition(".")[0]
    for name in names:
        value = scope.get(name, getattr(builtins, name, None))
        if value is None:  # imported inside the function: `import subprocess`, `from .. import x`
            value = next((sys.modules[m] for m in (name, f"{_OURS}.{name}", f"{package}.{name}")
                          if m in sys.modules), None)
        if isinstance(value, types.ModuleType):
            if _starter(value.__name__, names):
                return True
            for attr in names & set(vars(value)):  # the module's functions named: followed
                member = getattr(value, attr, None)
                if callable(member) and _follow(member, seen):
                    return True
        elif callable(value) and _follow(value, seen):
            return True
    return False


def _ours(module: str) -> bool:
    return (module == _OURS or module.startswith(_OURS + ".")) and module != __name__


def _follow(value: Any, seen: set[int]) -> bool:
    module = getattr(value, "__module__", None) or ""
    if _starter(module, {getattr(value, "__name__", "")}):
        return True
    if _ours(module) and isinstance(value, types.FunctionType | types.MethodType):
        return _reaches_a_starter(value, seen)
    return False


def starts_processes(item: pytest.Item) -> bool:
    """Whether the test (its function, fixtures and the suite's helpers they call) starts
    processes; a doctest or another non-function item does not."""
    if item.get_closest_marker(MARKER) is not None:
        return True
    function = getattr(item, "function", None)
    if function is None:
        return False
    seen: set[int] = set()
    fixtures = getattr(item, "_fixtureinfo", None)
    defs = fixtures.name2fixturedefs.values() if fixtures is not None else ()
    funcs = [function, *(d.func for group in defs for d in group)]
    return any(_reaches_a_starter(f, seen) for f in funcs)


# ---- the run-time guard, under --fast ----------------------------------------------------------
class StartedAProcess(AssertionError):
    pass


_PYTHONS = ("python", "accel-ctx", "torchrun")


def _a_python(args: Any) -> bool:
    first = args if isinstance(args, str | bytes | os.PathLike) else next(iter(args), "")
    text = os.fsdecode(first)
    name = Path(text.split()[0] if isinstance(args, str) else text).name
    return text == sys.executable or name.startswith(_PYTHONS)


def _refuse(what: str) -> None:
    raise StartedAProcess(
        f"this test starts {what} under --fast (the fast tier starts none); "
        f"mark it @pytest.mark.{MARKER} (tests/_fast.py did not see it)")


def guard(monkeypatch: pytest.MonkeyPatch) -> None:
    """For the running test: starting a Python process (subprocess, or a multiprocessing
    process that is not a cheap fork, e.g. a spawned rank) fails it."""
    popen_init = subprocess.Popen.__init__

    def checked_popen(self: subprocess.Popen[Any], args: Any, *rest: Any, **kw: Any) -> None:
        if _a_python(args):
            _refuse(f"a Python process ({args!r})")
        popen_init(self, args, *rest, **kw)

    start = multiprocessing.process.BaseProcess.start

    def checked_start(self: multiprocessing.process.BaseProcess) -> None:
        if getattr(self, "_start_method", None) in ("spawn", "forkserver"):
            _refuse(f"a {self._start_method} process")  # type: ignore[attr-defined]
        start(self)

    monkeypatch.setattr(subprocess.Popen, "__init__", checked_popen)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", checked_start)
