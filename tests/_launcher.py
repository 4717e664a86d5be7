"""Running `accel-ctx launch` from tests: start in a session of its own, wait, never leave it running.

Every command runs with a timeout; past it the launcher gets SIGTERM (torchrun then stops its
workers, which run in sessions of their own) and, if that is not enough, SIGKILL, so a test can
fail but never hang. Timeouts are scaled by tests/_timeouts.py's factor (a busy machine); the
launched scripts get that factor in their environment.

The launcher and its workers fork from a server that imported torch once (tests/_zygote.py;
the workers through torchrun's ``PYTHON_EXEC``) unless ``fresh_workers`` or
``ACCEL_CTX_TEST_FRESH_WORKERS=1`` asks for real interpreters, as
tests/launcher/test_cli_launch.py does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from . import _timeouts, _zygote

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"
ACCEL_CTX = str(Path(sys.executable).with_name("accel-ctx"))

# Launchers started by the running test; its module's autouse fixture calls stop_all().
STARTED: list[subprocess.Popen[bytes]] = []


def stop(proc: subprocess.Popen[bytes], grace: float = 40) -> None:
    """SIGTERM the launcher's process group, then SIGKILL it if it outlives ``grace`` seconds
    (scaled)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=_timeouts.scaled(grace))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def stop_all() -> None:
    """Whatever a test left running (it failed early) is stopped with its workers."""
    while STARTED:
        stop(STARTED.pop())


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "zombie" in status.read_text())


def start(args: list[str], tmp_path: Path, log: str, cwd: Path | None = None,
          prefix: tuple[str, ...] = (), drop: tuple[str, ...] = (), command: str = "launch",
          fresh_workers: bool = False, fresh_launcher: bool = False,
          fork_replica_workers: bool = False) -> tuple[subprocess.Popen[bytes], Path]:
    """Start ``accel-ctx launch ARGS`` (behind ``prefix``, e.g. `ip netns exec NS`), output to
    ``tmp_path/log``; ``drop`` names environment variables the launcher must not inherit;
    ``command`` another command of accel-ctx (``lighthouse``).

    The launcher and its workers fork from tests/_zygote.py's server, except: with
    ``fresh_workers`` (or a ``prefix``: its namespace holds the launcher and the workers) both
    are new interpreters, torchrun's own way; with ``fresh_launcher`` the launcher is, so that
    its workers are its descendants (a test that kills a node's whole process tree); with
    ``fork_replica_workers`` replica-group workers fork too (they restart within a second)."""
    (tmp_path / ".git").mkdir(exist_ok=True)  # a project root: no config file from above
    env = {**os.environ, **_timeouts.child_env(), "PYTHONPATH": str(ROOT),
           "OMP_NUM_THREADS": "1", "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    for var in drop:
        env.pop(var, None)
    if fork_replica_workers:
        env[_zygote.FORK_REPLICA_WORKERS] = "1"
    program = [*prefix, ACCEL_CTX]
    if not (fresh_workers or prefix or os.environ.get("ACCEL_CTX_TEST_FRESH_WORKERS") == "1"
            or "PYTHON_EXEC" in env):
        env["PYTHON_EXEC"] = _zygote.python_exec()
        if not fresh_launcher:  # the console script, run as `python -u accel-ctx ...` would
            program = [env["PYTHON_EXEC"], "-u", ACCEL_CTX]
    path = tmp_path / log
    with path.open("wb") as out:
        proc = subprocess.Popen([*program, command, *args], cwd=cwd or tmp_path,
                                env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    STARTED.append(proc)
    return proc, path


def finish(proc: subprocess.Popen[bytes], timeout: float) -> int:
    """The launcher's exit code; past ``timeout`` (scaled) it is stopped and TimeoutExpired
    raised (tests/conftest.py adds the machine's load to the failure)."""
    try:
        return proc.wait(timeout=_timeouts.scaled(timeout))
    except subprocess.TimeoutExpired:
        stop(proc)
        raise
