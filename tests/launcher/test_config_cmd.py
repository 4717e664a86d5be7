"""`accel-ctx config` (flags, questions on a terminal, --show) and `accel-ctx env`."""

from __future__ import annotations

import io
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomllib

from accel_ctx._launch import config as _config
from accel_ctx._launch.config_cmd import config_main
from accel_ctx.cli import main

from .._timeouts import scaled

ACCEL_CTX = str(Path(sys.executable).with_name("accel-ctx"))


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    project = tmp_path / "project"
    project.mkdir()
    (project / ".git").mkdir()
    monkeypatch.chdir(project)
    return tmp_path


def test_flags_round_trip_through_the_file_show_and_launch(home, capsys):
    assert main(["config", "-n", "3", "--mixed-precision", "bf16", "--max-restarts", "1"]) == 0
    path = home / "xdg" / "accel-ctx" / "config.toml"
    assert f"wrote {path}" in capsys.readouterr().out
    with path.open("rb") as f:
        assert tomllib.load(f) == {"nproc": 3, "mixed_precision": "bf16", "max_restarts": 1}
    # a later call changes one key and keeps the others
    assert main(["config", "--mixed-precision", "fp16"]) == 0
    assert _config.read_file(path) == {"nproc": 3, "mixed_precision": "fp16", "max_restarts": 1}
    # the project file overrides the user file, key by key; --show says which file says what
    assert main(["config", "--project", "-n", "auto"]) == 0
    capsys.readouterr()
    assert main(["config", "--show"]) == 0
    shown = capsys.readouterr().out
    assert 'nproc = "auto"' in shown and str(home / "project" / "accel-ctx.toml") in shown
    assert 'mixed_precision = "fp16"' in shown and str(path) in shown
    # an explicit file, multi-node settings included
    other = home / "cluster.toml"
    assert main(["config", "--config", str(other), "--nnodes", "2", "--master", "n0:29500",
                 "--node-rank", "1"]) == 0
    assert _config.read_file(other) == {"nnodes": 2, "master": "n0:29500", "node_rank": 1}
    from accel_ctx._launch.args import plan
    from accel_ctx.cli import torchrun_arity

    launched = plan(["--config", str(other), "t.py"], torchrun_arity(), os.environ)
    assert "--rdzv-endpoint" in launched.torchrun_args and launched.settings["node_rank"] == 1


def test_mistakes_in_flags_and_files_name_the_setting_and_the_fix(home, capsys):
    assert main(["config", "--nnodes", "2", "--node-rank", "2", "--config", "x.toml"]) == 2
    assert "node rank from 0 to 1" in capsys.readouterr().err
    assert not (home / "project" / "x.toml").exists()
    bad = home / "bad.toml"
    bad.write_text('nprocs = 4\n')
    assert main(["config", "--show", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "unknown setting 'nprocs'" in err and "Did you mean 'nproc'" in err
    bad.write_text('nproc = [4\n')
    assert main(["config", "--show", "--config", str(bad)]) == 2
    assert "cannot be read" in capsys.readouterr().err


def test_without_a_terminal_and_without_flags_it_asks_for_flags(home, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # not a terminal
    assert main(["config"]) == 2
    assert "no terminal" in capsys.readouterr().err
    assert not _config.user_file().exists()


def test_interview_stopped_with_ctrl_d_writes_nothing(home):
    answers = iter(["2"])

    def ask(prompt: str) -> str:
        try:
            return next(answers)
        except StopIteration:
            raise EOFError from None

    assert config_main([], ask=ask) == 1
    assert not _config.user_file().exists()


def _drive(argv, answers, cwd, env, timeout=60.0):
    """Run a command on a pseudo-terminal, answering each prompt that ends with ': '."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=env,
                            start_new_session=True)
    os.close(slave)
    transcript, pending = b"", list(answers)
    deadline = time.monotonic() + scaled(timeout)
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # the other side closed: the command ended
                    break
                if not chunk:
                    break
                transcript += chunk
                if pending and transcript.rstrip(b" ").endswith(b":"):
                    os.write(master, pending.pop(0).encode() + b"\n")
                    transcript += b"\n"
            elif proc.poll() is not None:
                break
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return proc.returncode, transcript.decode(errors="replace")


@pytest.mark.slow
def test_interactive_questions_on_a_terminal(tmp_path):
    target = tmp_path / "asked.toml"
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "xdg"), "OMP_NUM_THREADS": "1"}
    answers = ["4", "2", "not-an-address", "node0:29500", "", "bf16", "1", "1"]
    code, transcript = _drive([ACCEL_CTX, "config", "--config", str(target)], answers,
                              tmp_path, env)
    assert code == 0, transcript
    assert "Processes per machine" in transcript and "[auto]" in transcript
    assert "HOST:PORT" in transcript and "is not valid" in transcript  # asked again
    assert f"wrote {target}" in transcript
    assert _config.read_file(target) == {"nproc": 4, "nnodes": 2, "master": "node0:29500",
                                         "node_rank": 0, "mixed_precision": "bf16",
                                         "max_restarts": 1, "replica_groups": 1}


def test_env_report_names_versions_devices_and_config(home, capsys):
    import torch

    import accel_ctx

    main(["config", "-n", "2"])
    capsys.readouterr()
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert f"accel_ctx: {accel_ctx.__version__}" in out and f"torch: {torch.__version__}" in out
    assert "CUDA (torch built with):" in out and "gloo" in out
    assert "launch environment: single" in out
    assert "nproc = 2" in out and str(_config.user_file()) in out
