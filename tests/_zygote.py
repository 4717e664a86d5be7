"""Launched workers that fork from a server which imported torch once (tests only).

A worker torchrun starts is a fresh interpreter: ~4 s of this machine's CPU go to importing
torch and torch._dynamo (the optimizer's constructor loads it) before the script's first line,
and a test that kills and restarts its ranks pays that again at each restart. tests/_launcher.py
gives the launcher ``PYTHON_EXEC`` (torchrun's documented override of the workers' interpreter)
pointing at this module's client: a small program that hands its arguments, environment, folder
and standard streams to a server started once per pytest process, which forks a child that runs
the script as ``python -u SCRIPT ARGS`` (or ``-m NAME``) would. The launcher, torchrun, the
rendezvous, DDP/FSDP2, DCP and accel_ctx (imported afresh in each child) are the real ones.

The client stands in for the worker towards torchrun: it passes on the signals it gets
(SIGTERM, SIGINT, SIGHUP, SIGQUIT to the child's process group as torchrun's ``killpg`` would
reach a real worker's; SIGUSR1/SIGUSR2 to the child alone, as accel-ctx's forwarding does) and
ends as the child ended (its exit code, or killed by the same signal). A child whose client dies
(SIGKILLed by torchrun or a test) kills itself at once. The child starts as a fresh worker
would: its own session, the client's environment, folder, ``sys.argv``, ``sys.path[0]``,
unbuffered streams, default signal handlers, Python's and NumPy's global RNGs seeded afresh.
What a fork cannot give is left to the real interpreter: a request whose interpreter options or
import-time environment (``TORCH*``, ``PYTHON*``, ``OMP_*``...) differ from the server's runs
``python`` itself (``os.execv``), as does every request when the server cannot be reached;
``PYTHONWARNINGS`` is applied in the child. One thing no child can differ in: the string hash
seed (``PYTHONHASHSEED``), the server's for all; the demo (the README's quick start), the
import checks and tests/launcher/test_cli_launch.py run real interpreters. Single-process
scripts a test runs many times fork through ``run_script``; the examples fork as well.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import io
import json
import os
import select
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import _spawn

ROOT = Path(__file__).resolve().parent.parent
# Replica-group workers (these variables set) run real interpreters, unless the request's
# environment sets FORK_REPLICA_WORKERS. Forked, a killed group restarts within a second, before
# the lighthouse drops it: that showed a fault of accel_ctx's (the others did not check the new
# group again and sent it their gradients: a mismatched collective, gloo aborted), fixed, and the
# test of it forks on purpose; the others keep the timing a real interpreter gives, the one
# their assertions (the group seen leaving, then back) are written for.
_REPLICA_GROUPS = ("TORCHFT_LIGHTHOUSE", "REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS")
FORK_REPLICA_WORKERS = "ACCEL_CTX_TEST_FORK_REPLICA_WORKERS"
# `launch --replica-groups`'s group launchers fork too (they never restart; their workers do,
# as FORK_REPLICA_WORKERS says): a forked launcher finds this client as its sys.executable.
# A group launcher checks that its parent is the launcher named here
# (accel_ctx/_launch/replica_groups.py); forked, its parent is this server, which the child's
# variable then names, and the client, the launcher's real child, asks Linux for SIGTERM when
# the launcher dies (relayed to the child, as PR_SET_PDEATHSIG would send it to the real
# group launcher).
_PARENT_VAR = "ACCEL_CTX_REPLICA_LAUNCHER"
_LAUNCHERS = ("accel-ctx", "accel_ctx.cli")
# Read when used, not at import.
_ALLOWED = ("TORCHELASTIC_", "TORCH_NCCL_", "NCCL_", "OMP_NUM_THREADS", "PYTHONUNBUFFERED",
            "PYTHONWARNINGS",  # applied in the child (_warnings_as_asked)
            "PYTHON_EXEC")
_AT_IMPORT = ("TORCH", "PYTORCH", "PYTHON", "OMP_", "MKL", "KMP_", "CUDA", "NCCL", "LD_")
_GROUP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
_PID_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)

_CLIENT = r'''
import os, signal, socket, struct, sys, json
REAL, PATH = {real!r}, {path!r}
args = sys.argv[1:]
conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    conn.connect(PATH)
except OSError:
    os.execv(REAL, [REAL, *args])
if {parent_var!r} in os.environ:  # a replica group's launcher: it ends with the one above
    import ctypes
    ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
request = json.dumps({{"args": args, "env": dict(os.environ), "cwd": os.getcwd(),
                      "ppid": os.getppid()}}).encode()
socket.send_fds(conn, [struct.pack("!I", len(request)) + request], [0, 1, 2])
reader = conn.makefile("r")
first = reader.readline().split()
if not first or first[0] != "pid":
    os.execv(REAL, [REAL, *args])
child = int(first[1])
def relay(signum, frame, group={group!r}):
    try:
        (os.killpg if signum in group else os.kill)(child, signum)
    except OSError:
        pass
for s in {relayed!r}:
    signal.signal(s, relay)
last = reader.readline().split()
if len(last) == 2 and last[0] == "signal":
    if int(last[1]) != signal.SIGKILL:  # SIGKILL has no handler to reset (EINVAL)
        signal.signal(int(last[1]), signal.SIG_DFL)
    os.kill(os.getpid(), int(last[1]))
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(int(last[1]) if len(last) == 2 and last[0] == "exit" else 1)
'''

_server: subprocess.Popen[bytes] | None = None
# The server's environment before its imports, and what they set (torch sets
# TORCHINDUCTOR_CACHE_DIR): a request is compared with the first; its child gets the second too.
_BEFORE_IMPORTS: dict[str, str] = {}
_SET_BY_IMPORTS: dict[str, str] = {}
_FRESH_FILTERS = 0  # how many warning filters Python starts with (the server's, before imports)
_client: str | None = None


def python_exec() -> str:
    """The client's path for ``PYTHON_EXEC``; the server starts on first use (one per pytest
    process) and stops when the process exits."""
    global _server, _client
    if _client is not None and _server is not None and _server.poll() is None:
        return _client
    folder = Path(tempfile.mkdtemp(prefix="accel-ctx-zygote-"))
    path = str(folder / "socket")
    client = folder / "python"
    client.write_text(f"#!{sys.executable} -IS\n" + _CLIENT.format(
        real=sys.executable, path=path, group=[int(s) for s in _GROUP_SIGNALS],
        relayed=[int(s) for s in (*_GROUP_SIGNALS, *_PID_SIGNALS)], parent_var=_PARENT_VAR))
    client.chmod(client.stat().st_mode | stat.S_IXUSR)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "PYTHON_EXEC": str(client)}
    _server = subprocess.Popen(
        [sys.executable, "-c", f"from tests._zygote import serve; serve({path!r}, {os.getpid()})"],
        cwd=ROOT, env=env, start_new_session=True)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    atexit.register(_server.kill)  # runs first
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        if _server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the test zygote did not start (exit code {_server.poll()})")
        time.sleep(0.05)
    _client = str(client)
    return _client


def run_script(script: str, *args: str, env: dict[str, str] | None = None,
               **options: Any) -> subprocess.CompletedProcess[str]:
    """``python SCRIPT ARGS`` forked from the server (``subprocess.run``'s ``options``: ``cwd``,
    ``timeout``...; output captured as text): a single-process script a test runs many times
    over pays torch's import once. ``env`` goes over this process's environment with the
    server's ``PYTHONPATH`` and ``OMP_NUM_THREADS`` (a fork needs them: others make the client
    run the real interpreter). The client's exit code is the script's."""
    options.setdefault("capture_output", True)
    options.setdefault("text", True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([interpreter(), "-u", script, *args], env=env, **options)


def interpreter() -> str:
    """The client (``python_exec``), or the real interpreter where the run asks for fresh
    ones (``ACCEL_CTX_TEST_FRESH_WORKERS=1``)."""
    fresh = os.environ.get("ACCEL_CTX_TEST_FRESH_WORKERS") == "1"
    return sys.executable if fresh else python_exec()


def serve(path: str, owner: int) -> None:
    """The server's loop: fork a child per request, tell each client how its child ended; end
    when ``owner`` (the pytest process) is gone."""
    global _BEFORE_IMPORTS, _SET_BY_IMPORTS, _FRESH_FILTERS
    _BEFORE_IMPORTS = dict(os.environ)
    _FRESH_FILTERS = len(warnings.filters)
    for name in _spawn.PRELOAD:
        importlib.import_module(name)
    _SET_BY_IMPORTS = {k: v for k, v in os.environ.items() if _BEFORE_IMPORTS.get(k) != v}
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")
    listener.listen(64)
    os.rename(path + ".new", path)  # appears once it accepts
    clients: dict[int, socket.socket] = {}
    while True:
        ready, _, _ = select.select([listener], [], [], 0.05)
        if ready:
            conn, _ = listener.accept()
            _answer(conn, listener, clients)
        while clients:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = clients.pop(pid, None)
            if conn is not None:
                code = os.waitstatus_to_exitcode(status)
                word = f"signal {-code}" if code < 0 else f"exit {code}"
                with contextlib.suppress(OSError):
                    conn.sendall(f"{word}\n".encode())
                conn.close()
        try:
            os.kill(owner, 0)
        except ProcessLookupError:
            os._exit(0)


def _answer(conn: socket.socket, listener: socket.socket,
            clients: dict[int, socket.socket]) -> None:
    try:
        data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
        size = struct.unpack("!I", data[:4])[0]
        while len(data) < size + 4:
            more = conn.recv(1 << 16)
            if not more:
                raise ConnectionError("the client left")
            data += more
        request = json.loads(data[4:size + 4])
        target = _target(request["args"])
    except Exception:
        conn.close()
        return
    why = ("options" if target is None else "streams" if len(fds) != 3
           else _differs(request["env"], launcher=_is_launcher(target)))
    if why:  # the real interpreter runs it; said in the server's folder
        with open(os.path.join(os.path.dirname(listener.getsockname()), "exec.log"), "a") as f:
            f.write(f"{why}: {request['args']}\n")
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):
            conn.sendall(b"exec\n")
        conn.close()
        return
    pid = os.fork()
    if pid == 0:
        listener.close()
        for other in clients.values():
            other.close()
        _child(conn, fds, request, target)  # never returns
    for fd in fds:
        os.close(fd)
    clients[pid] = conn
    conn.sendall(f"pid {pid}\n".encode())


def _target(args: list[str]) -> tuple[str, str, list[str]] | None:
    """('file' or 'module', its name, its arguments) for ``-u SCRIPT ...`` or ``-u -m NAME ...``
    (torchrun's two forms; ``-m NAME ...`` too, a group launcher's); None for anything else
    (the real interpreter runs it)."""
    if args[:2] == ["-m", "accel_ctx.cli"]:
        args = ["-u", *args]  # the child's streams are unbuffered either way
    if args[:1] != ["-u"] or len(args) < 2:
        return None
    if args[1] == "-m":
        return ("module", args[2], args[3:]) if len(args) > 2 else None
    if args[1].startswith("-"):
        return None
    return "file", args[1], args[2:]


def _is_launcher(target: tuple[str, str, list[str]]) -> bool:
    """Whether ``target`` (of :func:`_target`) is ``accel-ctx``, or a group's launcher."""
    return os.path.basename(target[1]) in _LAUNCHERS


def _differs(env: dict[str, str], launcher: bool = False) -> str:
    """A variable that makes a replica group (a ``launcher`` may carry them: it is a group's
    launcher), or one read at import (by Python, torch, OpenMP, CUDA) whose value differs
    from the server's, which the child would not see; '' if none. What the server's imports set
    themselves may be there with the same value (a forked launcher passes it on)."""
    forked_groups = launcher or env.get(FORK_REPLICA_WORKERS) == "1"
    for key in _REPLICA_GROUPS:
        if key in env and not forked_groups:
            return key
    for key in set(env) | set(_BEFORE_IMPORTS):
        if not key.startswith(_AT_IMPORT) or key.startswith(_ALLOWED) or key in _REPLICA_GROUPS:
            continue
        if env.get(key) != _BEFORE_IMPORTS.get(key) and not (
                key in _SET_BY_IMPORTS and env.get(key) == _SET_BY_IMPORTS[key]):
            return key
    return ""


def _child(conn: socket.socket, fds: list[int], request: dict[str, object],
           target: tuple[str, str, list[str]]) -> None:
    code = 1
    try:
        os.setsid()  # torchrun starts each worker in a session of its own
        for signum in (*_GROUP_SIGNALS, *_PID_SIGNALS, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd, std in zip(fds, (0, 1, 2), strict=True):
            os.dup2(fd, std)
            os.close(fd)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                      errors="backslashreplace")
        env = request["env"]
        cwd = request["cwd"]
        assert isinstance(env, dict) and isinstance(cwd, str)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        for key, value in _SET_BY_IMPORTS.items():
            os.environ.setdefault(key, value)
        if env.get(_PARENT_VAR) == str(request.get("ppid")):
            os.environ[_PARENT_VAR] = str(os.getppid())
        how, name, args = target
        if _is_launcher(target):  # its replica groups' launchers fork too
            sys.executable = env.get("PYTHON_EXEC", sys.executable)
        threading.Thread(target=_die_with_client, args=(conn,), daemon=True).start()
        _fresh_state(env)
        _warnings_as_asked(env.get("PYTHONWARNINGS", ""))
        import runpy

        sys.argv = [name, *args]
        if how == "file":
            sys.path[0] = os.path.dirname(os.path.abspath(name))
            code = _run(lambda: runpy.run_path(name, run_name="__main__"))
        else:
            sys.path[0] = os.getcwd()
            code = _run(lambda: runpy.run_module(name, run_name="__main__", alter_sys=True))
    except BaseException:
        traceback.print_exc()
    finally:
        if code < 0:
            if -code != signal.SIGKILL:  # SIGKILL has no handler to reset (EINVAL)
                signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code)


def _warnings_as_asked(options: str) -> None:
    """The warning filters ``PYTHONWARNINGS=options`` gives a fresh interpreter: its filters
    go between those the server's imports added (in front, as after a real interpreter's
    imports) and Python's defaults. What torch's import warned in the server is not shown."""
    asked = [o for o in options.split(",") if o]
    if not asked or asked == sys.warnoptions:
        return
    imports_added = warnings.filters[:len(warnings.filters) - _FRESH_FILTERS]
    defaults = warnings.filters[len(imports_added):]
    warnings.filters[:] = []
    warnings._processoptions(asked)  # type: ignore[attr-defined]  # as Python's startup
    warnings.filters[:] = [*imports_added, *warnings.filters, *defaults]
    warnings._filters_mutated()  # type: ignore[attr-defined]
    sys.warnoptions[:] = asked  # what multiprocessing hands its children as -W


def _fresh_state(env: dict[str, str]) -> None:
    """What a fresh interpreter would not share with its siblings: the global RNGs' seeds."""
    import random

    random.seed()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    if "OMP_NUM_THREADS" in env:
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))


def _run(main: Callable[[], object]) -> int:
    """Run ``main`` as the interpreter runs a script: its exit code, threads joined, atexit run."""
    code = 0
    try:
        main()
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:  # Python ends by SIGINT then: see _child
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # non-daemon threads, as at exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return code


def _die_with_client(conn: socket.socket) -> None:
    """A child whose client is gone (SIGKILLed) goes at once, as the worker it stands for did."""
    try:
        while conn.recv(1 << 10):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)
