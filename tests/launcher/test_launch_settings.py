"""The launcher's one table of settings: every setting reaches the files, both commands and the
help; precision names mean the same to the launcher as to mixed_precision(); refused values are
quoted as written; the launcher wing loads neither the core nor torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from accel_ctx import mixed_precision, state
from accel_ctx._job.env import MIXED_PRECISION_VAR
from accel_ctx._launch import config_cmd
from accel_ctx._launch.args import OURS, parse, plan
from accel_ctx._launch.config import read_file, write
from accel_ctx._launch.help import launch_help
from accel_ctx._launch.settings import SETTINGS, check
from accel_ctx._precision.names import ALIASES, POLICIES
from accel_ctx.cli import main, torchrun_arity
from accel_ctx.errors import ConfigurationError

from .._timeouts import scaled

ARITY = torchrun_arity()
NAMES = sorted({*POLICIES, *ALIASES})
ROOT = Path(__file__).resolve().parents[2]


def launched(argv):
    return plan([*argv, "t.py"], ARITY, {"XDG_CONFIG_HOME": "/nonexistent"}, gpus=lambda: 0)


def test_every_setting_reaches_files_flags_questions_and_help(tmp_path):
    launch_text = launch_help()
    config_help = config_cmd.parser().format_help()
    for s in SETTINGS:
        value = check(s.key, s.example, "example")
        assert s.default is None or check(s.key, s.default, "default") == s.default
        assert s.question and s.meaning and s.help and s.fix
        for flag in s.flags:
            assert flag in launch_text and flag in config_help, flag
            assert OURS[flag] == s.key
            assert parse([flag, s.example, "t.py"], ARITY).ours == {s.key: s.example}
        assert config_cmd.parser().parse_args([s.flag, s.example]).__dict__[s.key] == s.example
        path = tmp_path / f"{s.key}.toml"
        write(path, {s.key: value})
        assert read_file(path) == {s.key: value}


def test_the_launch_flags_also_take_underscores_as_torchrun_does():
    assert OURS["--node_rank"] == "node_rank" and OURS["--mixed_precision"] == "mixed_precision"
    assert launched(["--max_restarts", "2"]).settings["max_restarts"] == 2


@pytest.mark.parametrize("name", [*NAMES, *(n.upper() for n in NAMES), "BFloat16"])
def test_every_policy_name_means_the_same_to_the_launcher_and_to_mixed_precision(
    name, tmp_path, monkeypatch
):
    monkeypatch.delenv(MIXED_PRECISION_VAR, raising=False)
    with mixed_precision(name):
        meant = state().mixed_precision
    assert meant in POLICIES
    sent = launched(["--mixed-precision", name]).env[MIXED_PRECISION_VAR]
    assert sent == meant
    file = tmp_path / "accel-ctx.toml"
    file.write_text(f'mixed_precision = "{name}"\n')
    assert read_file(file) == {"mixed_precision": meant}
    assert config_cmd.config_main(["--config", str(file), "--mixed-precision", name]) == 0
    assert read_file(file) == {"mixed_precision": meant}
    monkeypatch.setenv(MIXED_PRECISION_VAR, sent)  # what the workers read
    with mixed_precision():
        assert state().mixed_precision == meant


@pytest.mark.parametrize("name", ["fp4", "int8", "float64", ""])
def test_a_name_mixed_precision_refuses_the_launcher_refuses(name):
    with pytest.raises(ConfigurationError):
        mixed_precision(name)
    with pytest.raises(ConfigurationError,
                       match="'no', 'bf16', 'fp16', 'fp8', 'bf16-true' or 'fp16-true'"):
        launched(["--mixed-precision", name])


@pytest.mark.parametrize(("key", "bad"), [
    ("nproc", "abc"), ("nproc", 0), ("nproc", True), ("nnodes", "3:2"), ("nnodes", 0),
    ("nnodes", [2]), ("master", "nohost"), ("master", 29500), ("node_rank", -1),
    ("node_rank", "x"), ("mixed_precision", "fp4"), ("mixed_precision", 16),
    ("max_restarts", "-1"), ("max_restarts", 1.5),
])
def test_a_refused_value_is_quoted_as_written_never_as_none(key, bad):
    with pytest.raises(ConfigurationError) as info:
        check(key, bad, "here")
    message = str(info.value)
    assert message.startswith(f"here: {bad!r} is not valid (") and "None" not in message


def test_a_refused_value_in_a_file_is_quoted_as_written(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("nproc = 0\n")
    assert main(["config", "--show", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: nproc: 0 is not valid" in err and "None" not in err, err


def test_the_launcher_wing_loads_neither_the_core_nor_torch(tmp_path):
    """With a stub for the package root (whose __init__ imports the core and torch), the
    commands that start nothing run on the standard library and the leaf modules alone."""
    code = f"""
import sys, types
root = types.ModuleType("accel_ctx")
root.__path__ = [{str(ROOT / "accel_ctx")!r}]
root.__version__ = "test"
sys.modules["accel_ctx"] = root
import accel_ctx.cli
from accel_ctx._launch import (args, config, config_cmd, envinfo, fn, help, netif, nproc,
                              script, settings)
for argv in ([], ["--help"], ["launch"], ["config", "--help"], ["config", "--show"],
             ["config", "-n", "2", "--mixed-precision", "off"], ["env", "--help"]):
    try:
        accel_ctx.cli.main(argv)
    except SystemExit:
        pass
allowed = {{"accel_ctx", "accel_ctx.cli", "accel_ctx.errors", "accel_ctx._options",
           "accel_ctx._group", "accel_ctx._job.env", "accel_ctx._group.probe",
           "accel_ctx._job.coordinates",
           "accel_ctx._precision", "accel_ctx._precision.names", "accel_ctx._job"}}  # folders' __init__: empty
ours = sorted(m for m in sys.modules if m.startswith("accel_ctx") and m not in allowed
              and not m.startswith("accel_ctx._launch"))
assert not ours, ours
assert "torch" not in sys.modules
"""
    env = {"XDG_CONFIG_HOME": str(tmp_path / "xdg"), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=tmp_path, env=env, timeout=scaled(120))
    assert result.returncode == 0, result.stderr
