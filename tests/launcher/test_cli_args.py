"""`accel-ctx launch` flags -> torchrun flags and worker variables (no processes started)."""

from __future__ import annotations

import pytest

from accel_ctx._launch import config as _config
from accel_ctx._launch.args import plan
from accel_ctx.cli import main, torchrun_arity
from accel_ctx.errors import ConfigurationError

ARITY = torchrun_arity()


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An isolated user config folder and an empty project folder as the working directory."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text("")  # the project root stops the upward search
    monkeypatch.chdir(project)
    return tmp_path


def make(argv, environ=None, gpus=0, cwd=None):
    env = {"XDG_CONFIG_HOME": "/nonexistent"} if environ is None else environ
    return plan(argv, ARITY, env, cwd=cwd, gpus=lambda: gpus)


def flag(args, name):
    """The value torchrun will read for ``name`` (the last occurrence wins, as in argparse)."""
    values = [args[i + 1] for i, a in enumerate(args[:-1]) if a == name]
    return values[-1] if values else None


def test_n_counts_processes_per_node_and_the_script_keeps_its_own_flags():
    p = make(["-n", "3", "train.py", "-n", "5", "--lr", "1e-3"])
    assert flag(p.torchrun_args, "--nproc-per-node") == "3"
    assert p.torchrun_args[-5:] == ["train.py", "-n", "5", "--lr", "1e-3"]
    assert flag(make(["--nproc=4", "t.py"]).torchrun_args, "--nproc-per-node") == "4"
    assert flag(make(["-n2", "t.py"]).torchrun_args, "--nproc-per-node") == "2"


def test_auto_is_local_gpus_else_one():
    assert flag(make(["t.py"], gpus=0).torchrun_args, "--nproc-per-node") == "1"
    assert flag(make(["-n", "auto", "t.py"], gpus=4).torchrun_args, "--nproc-per-node") == "4"


def test_torchrun_flags_pass_through_with_their_values():
    args = make(["-n", "2", "--monitor-interval", "0.5", "-r", "3", "--log-dir=/tmp/x",
                 "--no-python", "--max-restarts", "2", "prog"]).torchrun_args
    assert args[args.index("--monitor-interval") + 1] == "0.5"
    assert args[args.index("-r") + 1] == "3" and "--log-dir=/tmp/x" in args
    assert "--no-python" in args and flag(args, "--max-restarts") == "2"
    assert args[-1] == "prog"
    # and torchrun's parser accepts the whole line
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser().parse_args(args)
    assert (parsed.nproc_per_node, parsed.max_restarts, parsed.training_script) == ("2", 2, "prog")


def test_single_node_meets_on_loopback_on_a_free_port():
    p = make(["-n", "2", "t.py"])
    assert flag(p.torchrun_args, "--rdzv-backend") == "c10d"
    assert flag(p.torchrun_args, "--rdzv-endpoint") == "127.0.0.1:0"
    assert flag(p.torchrun_args, "--local-addr") == "127.0.0.1"
    assert p.env.get("GLOO_SOCKET_IFNAME") in ("lo", "lo0", None)
    other = make(["-n", "2", "t.py"])
    assert flag(p.torchrun_args, "--rdzv-id") != flag(other.torchrun_args, "--rdzv-id")


def test_multi_node_uses_c10d_at_master_and_node_zero_hosts_it():
    p = make(["--nnodes", "2", "--node-rank", "1", "--master", "10.0.0.5:29400", "-n", "8", "t.py"])
    args = p.torchrun_args
    assert (flag(args, "--nnodes"), flag(args, "--rdzv-backend")) == ("2", "c10d")
    assert flag(args, "--rdzv-endpoint") == "10.0.0.5:29400"
    assert flag(args, "--rdzv-conf") == "is_host=false" and "--local-addr" not in args
    p0 = make(["--nnodes", "2", "--node-rank", "0", "--master", "h:1", "--rdzv-conf",
               "join_timeout=5", "t.py"])
    assert flag(p0.torchrun_args, "--rdzv-conf") == "join_timeout=5,is_host=true"
    assert p0.torchrun_args.count("--rdzv-conf") == 1
    loop = make(["--nnodes", "2", "--master", "127.0.0.1:2950", "t.py"])
    assert flag(loop.torchrun_args, "--local-addr") == "127.0.0.1"


def test_several_nodes_without_a_meeting_point_is_refused():
    with pytest.raises(ConfigurationError, match="--master HOST:PORT"):
        make(["--nnodes", "2", "t.py"])
    with pytest.raises(ConfigurationError, match="node ranks run from 0 to 1"):
        make(["--nnodes", "2", "--node-rank", "2", "--master", "h:1", "t.py"])
    with pytest.raises(ConfigurationError, match="HOST:PORT"):
        make(["--master", "nohost", "t.py"])


def test_torchrun_rendezvous_flags_replace_ours():
    args = make(["--rdzv-endpoint", "h:5", "--rdzv-backend", "c10d", "t.py"]).torchrun_args
    assert args.count("--rdzv-endpoint") == 1 and flag(args, "--rdzv-endpoint") == "h:5"
    static = make(["--nnodes", "2", "--node-rank", "1", "--master-addr", "h", "--master-port",
                   "5", "t.py"]).torchrun_args
    assert flag(static, "--node-rank") == "1" and "--rdzv-backend" not in static
    with pytest.raises(ConfigurationError, match="keep one"):
        make(["--master", "h:1", "--standalone", "t.py"])


def test_mixed_precision_reaches_the_workers_through_the_environment():
    assert make(["--mixed-precision", "BF16", "t.py"]).env["ACCEL_CTX_MIXED_PRECISION"] == "bf16"
    assert "ACCEL_CTX_MIXED_PRECISION" not in make(["t.py"]).env
    with pytest.raises(ConfigurationError,
                       match="'no', 'bf16', 'fp16', 'fp8', 'bf16-true' or 'fp16-true'"):
        make(["--mixed-precision", "fp4", "t.py"])


def test_mistakes_are_named():
    with pytest.raises(ConfigurationError, match="unknown option '--nprocs'"):
        make(["--nprocs", "2", "t.py"])
    with pytest.raises(ConfigurationError, match="give the script"):
        make(["-n", "2"])
    with pytest.raises(ConfigurationError, match="-n needs a value"):
        make(["-n"])
    with pytest.raises(ConfigurationError, match="processes per node"):
        make(["-n", "0", "t.py"])
    with pytest.raises(ConfigurationError, match="keep one"):
        make(["-n", "2", "--nproc-per-node", "3", "t.py"])


def test_config_files_project_over_user_and_flags_over_both(home):
    _config.write(_config.user_file(), {"nproc": 3, "mixed_precision": "fp16", "max_restarts": 2})
    env = {"XDG_CONFIG_HOME": str(home / "xdg")}
    p = make(["t.py"], environ=env)
    assert flag(p.torchrun_args, "--nproc-per-node") == "3"
    assert flag(p.torchrun_args, "--max-restarts") == "2"
    assert p.env["ACCEL_CTX_MIXED_PRECISION"] == "fp16"
    _config.write(home / "project" / "accel-ctx.toml", {"nproc": 5})
    sub = home / "project" / "src"
    sub.mkdir()
    p = make(["t.py"], environ=env, cwd=sub)  # found from a subfolder of the project
    assert flag(p.torchrun_args, "--nproc-per-node") == "5"
    assert p.env["ACCEL_CTX_MIXED_PRECISION"] == "fp16"  # keys the project file leaves alone
    assert p.sources["nproc"].endswith("accel-ctx.toml")
    p = make(["-n", "1", "--mixed-precision", "no", "t.py"], environ=env, cwd=sub)
    assert flag(p.torchrun_args, "--nproc-per-node") == "1" and p.sources["nproc"] == "flag"
    assert p.env["ACCEL_CTX_MIXED_PRECISION"] == "no"
    only = home / "only.toml"
    _config.write(only, {"nnodes": 2, "master": "h:7"})
    p = make(["--config", str(only), "t.py"], environ=env)  # that file and no other
    assert flag(p.torchrun_args, "--nproc-per-node") == "1"  # auto, with no GPU
    assert flag(p.torchrun_args, "--rdzv-endpoint") == "h:7"
    assert "ACCEL_CTX_MIXED_PRECISION" not in p.env


def test_slurm_fills_in_the_nodes_for_a_launcher_per_node():
    env = {"XDG_CONFIG_HOME": "/nonexistent", "SLURM_JOB_ID": "31", "SLURM_PROCID": "1",
           "SLURM_NODEID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "2",
           "SLURM_STEP_NODELIST": "gpu[1-2]"}
    args = make(["-n", "4", "t.py"], environ=env).torchrun_args
    assert (flag(args, "--nnodes"), flag(args, "--rdzv-endpoint")) == ("2", "gpu1:15031")
    assert flag(args, "--rdzv-conf") == "is_host=false" and flag(args, "--rdzv-id") == "slurm-31"


def test_help_says_n_counts_per_node(capsys):
    assert main(["launch", "--help"]) == 0
    text = capsys.readouterr().out
    assert "PER NODE" in text and "--max-restarts" in text and "accel-ctx.toml" in text
    assert main(["launch", "--bogus", "t.py"]) == 2
    assert "unknown option '--bogus'" in capsys.readouterr().err
