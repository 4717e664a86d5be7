"""Replica groups on several machines, the launcher's side without workers: `accel-ctx launch
--lighthouse HOST:PORT --replica-group I` and `accel-ctx lighthouse` (its arguments, its errors)."""

from __future__ import annotations

import os
import re
import socket
import sys
import threading
import time

import pytest

from accel_ctx._launch import config as _config
from accel_ctx._launch import replica_groups
from accel_ctx._launch.args import plan
from accel_ctx._launch.config_cmd import config_main
from accel_ctx.cli import main, torchrun_arity
from accel_ctx.errors import ConfigurationError

ARITY = torchrun_arity()
NO_FILES = {"XDG_CONFIG_HOME": "/nonexistent"}


def make(argv, environ=None, cwd=None):
    return plan(argv, ARITY, NO_FILES if environ is None else environ, cwd=cwd, gpus=lambda: 0)


def test_a_group_launcher_tells_its_workers_the_lighthouse_its_group_and_the_count():
    p = make(["-n", "2", "--lighthouse", "node0:29510", "--replica-group", "1",
              "--replica-groups", "3", "t.py"])
    assert p.env["TORCHFT_LIGHTHOUSE"] == "http://node0:29510"
    assert (p.env["REPLICA_GROUP_ID"], p.env["NUM_REPLICA_GROUPS"]) == ("1", "3")
    assert not replica_groups.wanted(p.settings, {})  # no lighthouse and groups of its own
    assert replica_groups.wanted(make(["--replica-groups", "3", "t.py"]).settings, {})
    # torchft's own spelling, IPv6, and one group alone (group 0 of 1) are fine
    p = make(["--lighthouse", "http://[fe80::1]:29510", "t.py"])
    assert p.env["TORCHFT_LIGHTHOUSE"] == "http://[fe80::1]:29510"
    assert (p.env["REPLICA_GROUP_ID"], p.env["NUM_REPLICA_GROUPS"]) == ("0", "1")
    for plain in (["t.py"], ["--replica-groups", "2", "t.py"]):  # one machine: run() sets them
        assert "TORCHFT_LIGHTHOUSE" not in make(plain).env


def test_the_lighthouse_may_come_from_the_config_file_the_group_from_the_flag(tmp_path):
    _config.write(tmp_path / "job.toml", {"lighthouse": "node0:29510", "replica_groups": 4})
    p = make(["--config", str(tmp_path / "job.toml"), "--replica-group", "3", "t.py"])
    assert p.env["TORCHFT_LIGHTHOUSE"] == "http://node0:29510"
    assert (p.env["REPLICA_GROUP_ID"], p.env["NUM_REPLICA_GROUPS"]) == ("3", "4")
    assert p.sources["lighthouse"].endswith("job.toml")


@pytest.mark.parametrize(("argv", "words"), [
    (["--replica-group", "1"], "--replica-group 1 needs --lighthouse HOST:PORT"),
    (["--lighthouse", "h:1", "--replica-group", "2", "--replica-groups", "2"],
     "--replica-group 2 with --replica-groups 2: the groups are numbered 0 to 1"),
    (["--lighthouse", "h:1", "--replica-groups", "2"],
     "--lighthouse with --replica-groups 2: say which group this launcher starts"),
    (["--lighthouse", "h", "--replica-group", "0"], "--lighthouse: 'h' is not valid"),
    (["--lighthouse", "h:1", "--replica-group", "-1"], "--replica-group: '-1' is not valid"),
])
def test_a_group_that_cannot_be_is_refused_in_one_line(argv, words, capsys, monkeypatch):
    with pytest.raises(ConfigurationError, match=words.replace("(", r"\(")):
        make([*argv, "t.py"])
    monkeypatch.setenv("XDG_CONFIG_HOME", "/nonexistent")
    assert main(["launch", *argv, __file__]) == 2  # before anything starts
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("accel-ctx launch: ") and words in err


def test_config_asks_no_group_question_and_keeps_the_lighthouse(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    target = tmp_path / "c.toml"
    assert config_main(["--config", str(target), "--lighthouse", "http://n0:29510"]) == 0
    asked = []

    def ask(prompt):
        asked.append(prompt)
        return ""  # every default

    assert config_main(["--config", str(target)], ask=ask) == 0
    assert not any("lighthouse" in q or "replica group (" in q for q in asked), asked
    assert _config.read_file(target)["lighthouse"] == "n0:29510"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_lighthouse_is_named_with_the_fix_and_a_late_one_is_waited_for():
    port = _closed_port()
    start = time.monotonic()
    why = replica_groups.unreachable({"lighthouse": f"127.0.0.1:{port}"}, seconds=1)
    assert time.monotonic() - start < 20
    assert f"lighthouse at http://127.0.0.1:{port} within 1 s" in why
    assert "accel-ctx lighthouse" in why and "--lighthouse" in why
    assert replica_groups.unreachable({}) == ""  # no --lighthouse: nothing to reach
    torchft = pytest.importorskip("torchft.coordination")
    port = _closed_port()
    late = []  # it starts after the group launcher (a real lighthouse: only that one passes)
    timer = threading.Timer(2.0, lambda: late.append(
        torchft.LighthouseServer(bind=f"127.0.0.1:{port}", min_replicas=1)))
    timer.start()
    try:
        assert replica_groups.unreachable({"lighthouse": f"127.0.0.1:{port}"}, seconds=60) == ""
    finally:
        timer.join()
        for server in late:
            server.shutdown()


def test_the_replica_timeout_comes_from_the_environment_and_a_bad_one_is_named(
        capsys, monkeypatch):
    port = _closed_port()
    monkeypatch.setenv("XDG_CONFIG_HOME", "/nonexistent")
    monkeypatch.setenv("ACCEL_CTX_REPLICA_TIMEOUT", "1.5")
    why = replica_groups.unreachable({"lighthouse": f"127.0.0.1:{port}"})
    assert f"lighthouse at http://127.0.0.1:{port} within 1.5 s" in why
    for bad in ("soon", "0", "-3", "inf"):
        monkeypatch.setenv("ACCEL_CTX_REPLICA_TIMEOUT", bad)
        assert main(["launch", "--lighthouse", f"127.0.0.1:{port}", "--replica-group", "0",
                     __file__]) == 2  # before anything starts
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert f"ACCEL_CTX_REPLICA_TIMEOUT={bad!r}: give a positive number of seconds" in err
    monkeypatch.setenv("ACCEL_CTX_REPLICA_TIMEOUT", "soon")  # the groups of one machine too
    assert main(["launch", "--replica-groups", "2", __file__]) == 2
    assert "ACCEL_CTX_REPLICA_TIMEOUT='soon'" in capsys.readouterr().err


def test_the_replica_timeout_is_a_flag_and_a_config_key_for_the_launcher_and_its_workers(
        tmp_path, capsys, monkeypatch):
    port = _closed_port()
    monkeypatch.setenv("XDG_CONFIG_HOME", "/nonexistent")
    monkeypatch.setenv("ACCEL_CTX_REPLICA_TIMEOUT", "soon")  # the flag replaces it: not named
    began = time.monotonic()
    assert main(["launch", "--lighthouse", f"127.0.0.1:{port}", "--replica-group", "0",
                 "--replica-timeout", "1.5", __file__]) == 1
    assert f"lighthouse at http://127.0.0.1:{port} within 1.5 s" in capsys.readouterr().err
    assert time.monotonic() - began < 20  # waited 1.5 s for it, not the default 30
    assert os.environ["ACCEL_CTX_REPLICA_TIMEOUT"] == "1.5"  # what its groups' workers read
    _config.write(tmp_path / "job.toml", {"replica_timeout": 90})
    p = make(["--config", str(tmp_path / "job.toml"), "--replica-groups", "2", "t.py"])
    assert p.settings["replica_timeout"] == "90"
    for bad in ("0", "-2", "inf", "soon"):
        with pytest.raises(ConfigurationError, match="give a positive number of seconds"):
            make(["--replica-timeout", bad, "t.py"])


def test_lighthouse_refuses_a_taken_port_bad_numbers_and_a_missing_torchft(capsys, monkeypatch):
    pytest.importorskip("torchft")
    monkeypatch.setenv("RUST_LOG", "warn")  # what the command sets for the Rust server
    with socket.socket(socket.AF_INET6) as held:
        held.bind(("::", 0))
        held.listen()
        assert main(["lighthouse", "--port", str(held.getsockname()[1])]) == 2
    err = capsys.readouterr().err
    assert "cannot listen on [::]:" in err and "give another --port" in err
    assert main(["lighthouse", "--min-replicas", "0"]) == 2
    assert "--min-replicas 1 or more" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "torchft.coordination", None)  # as if not installed
    assert main(["lighthouse", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("accel-ctx lighthouse: ") and "pip install 'accel-ctx[ft]'" in err


# --- issue 53: limits, the lighthouse's address, something else at --lighthouse -------------

@pytest.mark.parametrize(("argv", "words"), [
    (["--replica-groups", "1000"], "--replica-groups 1000 starts 1000 group launchers on this "
     "machine"),
    (["--replica-groups", "16", "-n", "8"], "--replica-groups 16 with -n 8 (16 groups of 8) "
     "asks for 128 processes on this machine"),
    (["--replica-groups", "16", "--nproc-per-node", "8"], "asks for 128 processes"),
])
def test_replica_groups_on_one_machine_have_the_limits_of_n_alone(argv, words, capsys,
                                                                    monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", "/nonexistent")
    monkeypatch.delenv("ACCEL_CTX_MAX_NPROC", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 2)  # the limits: 16 groups, 64 processes
    with pytest.raises(ConfigurationError, match=re.escape(words)):  # planned: nothing started
        make([*argv, "t.py"], {**NO_FILES})
    assert main(["launch", *argv, __file__]) == 2  # refused before anything starts
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("accel-ctx launch: ") and words in err, err
    assert "at most" in err and "ACCEL_CTX_MAX_NPROC=" in err and "--lighthouse" in err, err
    with pytest.raises(ConfigurationError, match="asks for 128 processes"):
        make(["-n", "128", "t.py"])  # the limit they share with -n alone
    # under the limit, set higher, or one group of a job on several machines: no refusal
    make(["--replica-groups", "8", "-n", "8", "t.py"])
    make(["--replica-groups", "16", "-n", "8", "t.py"], {**NO_FILES, "ACCEL_CTX_MAX_NPROC": "128"})
    make(["--lighthouse", "h:1", "--replica-group", "0", "--replica-groups", "1000", "-n", "8",
          "t.py"])


def test_the_lighthouse_bind_address_is_a_setting_of_the_files_and_a_flag(
        tmp_path, capsys, monkeypatch):
    from accel_ctx._launch.lighthouse import lighthouse_main

    monkeypatch.setenv("RUST_LOG", "warn")  # what the command sets for the Rust server

    _config.write(tmp_path / "job.toml", {"lighthouse_bind": "0.0.0.0"})
    p = make(["--config", str(tmp_path / "job.toml"), "--replica-groups", "2", "t.py"])
    assert p.settings["lighthouse_bind"] == "0.0.0.0"
    assert make(["--lighthouse-bind", "[::]", "t.py"]).settings["lighthouse_bind"] == "[::]"
    with pytest.raises(ConfigurationError, match="give an IP address of this machine"):
        make(["--lighthouse-bind", "node0", "t.py"])
    # `accel-ctx lighthouse` reads it from the files when --bind is not given
    project = tmp_path / "project"
    (project / ".git").mkdir(parents=True)
    _config.write(project / "accel-ctx.toml", {"lighthouse_bind": "10.255.255.1"})
    monkeypatch.chdir(project)
    pytest.importorskip("torchft")
    assert lighthouse_main(["--port", "0"]) == 2  # not this machine's address: named
    assert "cannot listen on 10.255.255.1:0" in capsys.readouterr().err


def _serve_once(answer: bytes | None) -> tuple[socket.socket, threading.Thread]:
    """A server on loopback that is no lighthouse: it answers ``answer`` to what it reads, or
    closes the connection at once (None)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                if answer is not None:
                    conn.recv(4096)
                    conn.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return server, thread


def test_something_else_at_lighthouse_is_named_within_seconds_and_nothing_starts(
        capsys, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", "/nonexistent")
    http = b"HTTP/1.0 404 Not Found\r\nContent-Length: 0\r\n\r\n"
    for answer, words in ((http, "it answered 'HTTP/1.0 404 Not Found'"),
                          (None, "it closed the connection without an answer")):
        server, thread = _serve_once(answer)
        port = server.getsockname()[1]
        try:
            start = time.monotonic()
            assert main(["launch", "--lighthouse", f"127.0.0.1:{port}", "--replica-group", "0",
                         str(__import__("pathlib").Path(__file__))]) == 1
            assert time.monotonic() - start < 30  # not the 30 s replica timeout, and no worker
        finally:
            server.close()
            thread.join(5)
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert (f"accel-ctx launch: something answers at http://127.0.0.1:{port}, but it is not "
                f"a torchft lighthouse ({words}): another program holds that port") in err, err
    # torchft's own lighthouse passes
    torchft = pytest.importorskip("torchft.coordination")
    real = torchft.LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    try:
        port = int(real.address().rsplit(":", 1)[1])
        assert replica_groups.unreachable({"lighthouse": f"127.0.0.1:{port}"}, seconds=5) == ""
    finally:
        real.shutdown()
