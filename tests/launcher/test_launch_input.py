"""Issue 24, the launcher's input, without processes: what is to run is checked before anything
starts, everything after the script's name is the script's own, one rule says where each
setting comes from (and every text that states it agrees), and `accel-ctx` alone is a usage
error that prints the help."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from accel_ctx import cli
from accel_ctx._launch import config as _config
from accel_ctx._launch.args import plan
from accel_ctx._launch.config_cmd import parser as config_parser
from accel_ctx._launch.help import launch_help
from accel_ctx.cli import main, torchrun_arity

ROOT = Path(__file__).resolve().parents[2]
ARITY = torchrun_arity()
# torchrun options a script's own flags begin like: argparse would call each ambiguous
SCRIPT_OWN = ["--log", "x", "--run", "y", "--max", "1", "--node", "2", "--local", "3",
              "--start", "4", "--nproc-per-node", "9", "-n", "5", "--", "--config", "c"]


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A project folder as the working directory, no user file; torchrun is not started: the
    options it would be given are recorded instead."""
    runs: list[object] = []
    monkeypatch.setattr(cli, "run_torchrun", lambda options, settings, note="": runs.append(
        options) or 0)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # so the launcher sets no variable itself
    monkeypatch.delenv("PYTHON_EXEC", raising=False)
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / ".git").mkdir()
    (folder / "train.py").write_text("print('hi')\n")
    monkeypatch.chdir(folder)
    return folder, runs


def _refused(capsys, argv):
    code = main(["launch", *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, (code, err)
    return err


def test_a_script_that_is_not_there_ends_the_launcher_in_one_line(project, capsys):
    folder, runs = project
    assert "script 'missing.py' does not exist in" in _refused(capsys, ["-n", "2", "missing.py"])
    assert "did you mean 'train.py'" in _refused(capsys, ["-n", "2", "trian.py"])
    (folder / "tool").mkdir()
    assert "'tool' is a folder without __main__.py" in _refused(capsys, ["tool"])
    assert "module 'no_such_module' is not found" in _refused(capsys, ["-m", "no_such_module"])
    (folder / "pkg").mkdir()
    (folder / "pkg" / "__init__.py").write_text("")
    (folder / "pkg" / "main.py").write_text("")
    assert "module 'pkg.mian' is not found" in _refused(capsys, ["--module", "pkg.mian"])
    assert "'train' is a module, not a package" in _refused(capsys, ["-m", "train.x"])
    assert "command 'no-such-command-24' is not found on PATH" in _refused(
        capsys, ["--no-python", "no-such-command-24"])
    (folder / "run.sh").write_text("#!/bin/sh\n")
    assert "'./run.sh' is not executable" in _refused(capsys, ["--no-python", "./run.sh"])
    assert "keep one of them" in _refused(capsys, ["--no-python", "-m", "pkg.main"])
    assert "'pkg' is a package without __main__.py" in _refused(capsys, ["-m", "pkg"])
    assert runs == []
    # what does run, as the workers will see it, starts torchrun
    (folder / "tool" / "__main__.py").write_text("")
    (folder / "pkg" / "__main__.py").write_text("")
    (folder / "run.sh").chmod(0o755)
    for argv in (["train.py"], [str(folder / "train.py")], ["tool"], ["-m", "pkg.main"],
                 ["-m", "pkg"], ["-m", "json.tool"], ["--no-python", "./run.sh"],
                 ["--no-python", "true"], ["--run-path", "train.py"]):
        assert main(["launch", "-n", "1", *argv]) == 0, capsys.readouterr().err
    assert len(runs) == 9


def test_everything_after_the_script_is_the_scripts_own(project, capsys):
    _, runs = project
    assert main(["launch", "-n", "2", "--log-dir", "logs", "train.py", *SCRIPT_OWN]) == 0
    options = runs[-1]
    assert options.training_script == "train.py"
    assert options.training_script_args == SCRIPT_OWN
    assert (options.nproc_per_node, options.log_dir) == ("2", "logs")
    assert main(["launch", "-n", "1", "--", "train.py", "--log", "x"]) == 0
    assert runs[-1].training_script_args == ["--log", "x"]


def test_each_setting_comes_from_the_first_level_that_gives_it(tmp_path):
    """flag > SLURM > --config FILE > project file > user file > default, peeled one at a
    time: swapping any two levels fails one of the steps."""
    project = tmp_path / "project"
    project.mkdir()
    (project / ".git").mkdir()
    user = {"XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    _config.write(_config.user_file(user), {"nnodes": 2, "master": "user:1", "max_restarts": 5})
    _config.write(project / "accel-ctx.toml",
                  {"nnodes": 3, "master": "project:1", "mixed_precision": "fp16"})
    named = tmp_path / "named.toml"
    _config.write(named, {"nnodes": 4, "master": "named:1"})
    slurm = {"SLURM_JOB_ID": "7", "SLURM_NODEID": "0", "SLURM_STEP_NUM_TASKS": "5",
             "SLURM_STEP_NUM_NODES": "5", "SLURM_STEP_NODELIST": "s[1-5]"}

    def nnodes(argv, environ):
        p = plan([*argv, "t.py"], ARITY, environ, cwd=project, gpus=lambda: 0)
        given = int(p.torchrun_args[p.torchrun_args.index("--nnodes") + 1])  # torchrun's
        return given, p.sources.get("nnodes", "default"), p.settings

    config = ["--config", str(named)]
    assert nnodes(["--nnodes", "6", *config], {**user, **slurm})[:2] == (6, "flag")
    assert nnodes(config, {**user, **slurm})[:2] == (5, "SLURM")
    found, where, settings = nnodes(config, user)
    assert (found, where) == (4, str(named))
    assert "mixed_precision" not in settings and "max_restarts" not in settings  # not read
    found, where, settings = nnodes([], user)
    assert (found, where) == (3, str(project / "accel-ctx.toml"))
    assert settings["max_restarts"] == 5  # without --config the two files add up, key by key
    (project / "accel-ctx.toml").unlink()
    assert nnodes([], user)[:2] == (2, str(_config.user_file(user)))
    assert nnodes([], {"XDG_CONFIG_HOME": str(tmp_path / "none")})[:2] == (1, "default")


def _words(text: str) -> str:
    return " ".join(text.split())


def test_the_rule_is_said_alike_in_the_readme_and_both_helps():
    levels = ["command line", "SLURM", "--config FILE", "accel-ctx.toml", "config.toml",
              "built-in defaults"]
    readme = (ROOT / "README.md").read_text()
    section = readme.split("<!-- --8<-- [start:precedence] -->")[1].split(
        "<!-- --8<-- [end:precedence] -->")[0]
    items = re.findall(r"^\d+\. (.*?)(?=^\d+\. |^$)", section, flags=re.M | re.S)
    for said in (items, list(_config.PRECEDENCE)):
        assert len(said) == len(levels), said
        for level, text in zip(levels, said, strict=True):
            assert [m for m in levels if m in text] == [level], (level, text)
    rule = _words(_config.precedence())
    assert rule in _words(launch_help())
    assert rule in _words(config_parser().format_help())
    assert "--config FILE" in launch_help() and "instead of the project and user files" in \
        _words(launch_help())


def test_accel_ctx_alone_prints_the_help_and_exits_2(capsys):
    assert main([]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("usage: accel-ctx")
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert text == out.err and "accel-ctx --version" in text
    assert main(["--version"]) == 0 and capsys.readouterr().out.startswith("accel-ctx ")
    assert main(["launch"]) == 2
    assert capsys.readouterr().err.startswith("usage: accel-ctx launch")
