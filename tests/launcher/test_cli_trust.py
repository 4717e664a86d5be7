"""Issue 11, launcher side, without processes: input checking (15), absurd process counts (9),
the launcher's precision against the script's (16), and the addresses a node advertises (20)."""

from __future__ import annotations

import warnings

import pytest

from accel_ctx import cli, launch, mixed_precision
from accel_ctx._launch.args import plan
from accel_ctx._launch.config_cmd import config_main
from accel_ctx._precision import runtime as _precision_runtime
from accel_ctx.cli import main, torchrun_arity
from accel_ctx.errors import ConfigurationError

ARITY = torchrun_arity()


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An isolated config folder; torchrun is never reached (a bad value must stop before)."""

    def no_torchrun(*args, **kwargs):
        pytest.fail(f"the launcher went on to start torchrun with {args[0]}")

    monkeypatch.setattr(cli, "run_torchrun", no_torchrun)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("ACCEL_CTX_MAX_NPROC", raising=False)
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text("")
    monkeypatch.chdir(project)
    return tmp_path


def make(argv, environ=None, route=None):
    env = {"XDG_CONFIG_HOME": "/nonexistent"} if environ is None else environ
    extra = {} if route is None else {"route": route}
    return plan(argv, ARITY, env, gpus=lambda: 0, **extra)


def flag(args, name):
    values = [args[i + 1] for i, a in enumerate(args[:-1]) if a == name]
    return values[-1] if values else None


# --- 15: rejected values are quoted as typed; no traceback; each answer checked when given ---

@pytest.mark.parametrize(("argv", "quoted"), [
    (["--mixed-precision", "fp4"], "'fp4' is not valid"),
    (["-n", "abc"], "'abc' is not valid"),
    (["--max-restarts", "-1"], "'-1' is not valid"),
    (["--nnodes", "0"], "'0' is not valid"),
    (["--nnodes", "abc"], "'abc' is not valid"),
    (["--nnodes", "3:2"], "'3:2' is not valid"),
    (["--node-rank", "x"], "'x' is not valid"),
    (["--nproc-per-node", "0"], "--nproc-per-node '0' is not valid"),
    (["--nproc-per-node", "many"], "--nproc-per-node 'many' is not valid"),
])
def test_launch_rejects_bad_values_in_one_line_quoting_them(home, capsys, argv, quoted):
    assert main(["launch", *argv, "t.py"]) == 2
    err = capsys.readouterr().err
    assert quoted in err and "None" not in err and "Traceback" not in err, err
    assert err.count("\n") == 1


def test_config_flags_are_checked_like_the_launcher_flags(home, capsys):
    for argv, quoted in ((["--nnodes", "3:2"], "'3:2'"), (["--nnodes", "0"], "'0'"),
                         (["-n", "abc"], "'abc'"), (["--mixed-precision", "fp4"], "'fp4'"),
                         (["--max-restarts", "-1"], "'-1'")):
        assert config_main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"{quoted} is not valid" in err and "None" not in err, err
    assert not (home / "xdg" / "accel-ctx" / "config.toml").exists()
    assert config_main(["--nnodes", "2:4", "--master", "h:1"]) == 0  # elastic MIN:MAX is fine
    assert 'nnodes = "2:4"' in (home / "xdg" / "accel-ctx" / "config.toml").read_text()


def test_interview_checks_each_answer_when_given_and_asks_it_again(home, capsys):
    answers = iter(["abc", "2",          # nproc
                    "3:2", "2",          # nnodes
                    "h:1",               # master
                    "5", "1",            # node_rank: out of range for 2 nodes, asked at once
                    "fp4", "bf16",       # mixed_precision
                    "-1", "0",           # max_restarts
                    "0", "1"])           # replica_groups
    asked = []

    def ask(prompt):
        asked.append(prompt.split(" [")[0].split(":")[0])
        return next(answers)

    assert config_main([], ask=ask) == 0
    out = capsys.readouterr().out
    assert [q.split()[0] for q in asked] == ["Processes", "Processes", "Machines", "Machines",
                                             "Address", "This", "This", "Mixed", "Mixed",
                                             "Restarts", "Restarts", "Fault-tolerant",
                                             "Fault-tolerant"]
    for bad in ("'abc'", "'3:2'", "'fp4'", "'-1'", "'0'"):
        assert f"{bad} is not valid" in out
    assert "node_rank 5 with 2 machine(s)" in out and "None" not in out
    text = (home / "xdg" / "accel-ctx" / "config.toml").read_text()
    assert "nproc = 2" in text and "node_rank = 1" in text and 'mixed_precision = "bf16"' in text


# --- 9: absurd process counts are refused before anything starts ---

def test_absurd_process_counts_are_refused_up_front(home, capsys, monkeypatch):
    assert main(["launch", "-n", "1000000", "t.py"]) == 2
    err = capsys.readouterr().err
    assert "-n 1000000 asks for 1000000 processes" in err and "ACCEL_CTX_MAX_NPROC" in err
    with pytest.raises(ConfigurationError, match="more than it can run"):
        make(["-n", "65", "t.py"], environ={"XDG_CONFIG_HOME": "/x", "ACCEL_CTX_MAX_NPROC": "64"})
    with pytest.raises(ConfigurationError, match="--nproc-per-node 100000"):
        make(["--nproc-per-node", "100000", "t.py"])
    with pytest.raises(ConfigurationError, match="ACCEL_CTX_MAX_NPROC='x'"):
        make(["-n", "2", "t.py"], environ={"XDG_CONFIG_HOME": "/x", "ACCEL_CTX_MAX_NPROC": "x"})
    allowed = make(["-n", "100", "t.py"], environ={"XDG_CONFIG_HOME": "/x",
                                                   "ACCEL_CTX_MAX_NPROC": "100"})
    assert flag(allowed.torchrun_args, "--nproc-per-node") == "100"
    assert flag(make(["-n", "64", "t.py"]).torchrun_args, "--nproc-per-node") == "64"
    with pytest.raises(ConfigurationError, match=r"launch\(nprocs=1000000\)"):
        launch(abs, nprocs=1_000_000, args=(1,))


# --- 14: exit codes ---

def test_exit_codes_follow_the_script_and_the_shell(capsys):
    from accel_ctx.cli import failure_exit_code, interrupted

    class Failure:
        def __init__(self, code):
            self.exitcode = code

    class Failed:
        def __init__(self, code):
            self.code = code

        def get_first_failure(self):
            return 1, Failure(self.code)

    assert [failure_exit_code(Failed(c)) for c in (3, 1, -9, -15)] == [3, 1, 137, 143]
    assert interrupted(2) == 130 and interrupted(15) == 143
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["accel-ctx launch: interrupted (Ctrl-C); every worker was stopped.",
                     "accel-ctx launch: stopped by SIGTERM; every worker was stopped."]


# --- 16: an explicit policy wins over the launcher's, and the conflict is said once ---

def test_an_explicit_policy_wins_and_a_conflict_with_the_launcher_warns_once(monkeypatch):
    monkeypatch.setenv("ACCEL_CTX_MIXED_PRECISION", "bf16")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(_precision_runtime, "_CONFLICTS_REPORTED", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with mixed_precision("no"):
                pass
        with mixed_precision(), mixed_precision(None), mixed_precision("bfloat16"):
            pass  # following the launcher, or agreeing with it, says nothing
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert "mixed_precision('no')" in messages[0] and "--mixed-precision bf16" in messages[0]
    assert caught[0].filename == __file__  # points at the user's line
    monkeypatch.setattr(_precision_runtime, "_CONFLICTS_REPORTED", set())
    monkeypatch.setenv("RANK", "1")  # other ranks stay quiet
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mixed_precision("fp16")
    assert caught == []


# --- 20: what a node advertises, and which interface its workers use ---

def test_node_zero_advertises_the_master_and_others_their_address_towards_it():
    from accel_ctx._launch.netif import Route

    def route(host, port):
        assert (host, port) == ("10.0.0.5", 29400)
        return Route("10.0.0.7", "eth1")

    base = ["--nnodes", "2", "--master", "10.0.0.5:29400", "-n", "1"]
    one = make([*base, "--node-rank", "1", "t.py"], route=route)
    assert flag(one.torchrun_args, "--local-addr") == "10.0.0.7"
    assert one.env["GLOO_SOCKET_IFNAME"] == one.env["NCCL_SOCKET_IFNAME"] == "eth1"
    assert "from 10.0.0.7 (interface eth1)" in one.network.note
    assert "advertised 10.0.0.7" in one.network.note and "node rank 1" in one.network.note
    zero = make([*base, "--node-rank", "0", "t.py"], route=route)
    assert flag(zero.torchrun_args, "--local-addr") == "10.0.0.5"
    assert zero.env["GLOO_SOCKET_IFNAME"] == "eth1"
    mine = make([*base, "--node-rank", "1", "--local-addr", "10.9.9.9", "t.py"], route=route,
                environ={"XDG_CONFIG_HOME": "/x", "GLOO_SOCKET_IFNAME": "ib0"})
    assert mine.torchrun_args.count("--local-addr") == 1
    assert flag(mine.torchrun_args, "--local-addr") == "10.9.9.9"
    assert "GLOO_SOCKET_IFNAME" not in mine.env and mine.env["NCCL_SOCKET_IFNAME"] == "eth1"
    lost = make([*base, "--node-rank", "1", "t.py"], route=lambda h, p: None)
    assert "--local-addr" not in lost.torchrun_args and lost.env == {}
    assert "no route" in lost.network.note


def test_a_master_that_resolves_to_loopback_on_node_zero_is_said_at_once():
    from accel_ctx._launch.netif import Route

    p = make(["--nnodes", "2", "--node-rank", "0", "--master", "node0:29400", "t.py"],
             route=lambda h, port: Route("127.0.1.1", "lo"))
    assert "resolves to 127.0.1.1 (loopback)" in p.network.warning
    assert "GLOO_SOCKET_IFNAME" not in p.env and flag(p.torchrun_args, "--local-addr") == "node0"
    loop = make(["--nnodes", "2", "--master", "127.0.0.1:2950", "t.py"],
                route=lambda h, port: Route("127.0.0.1", "lo"))
    assert not loop.network.warning and loop.env["GLOO_SOCKET_IFNAME"] == "lo"
    assert flag(loop.torchrun_args, "--local-addr") == "127.0.0.1"


def test_the_route_to_loopback_is_found_on_this_machine():
    from accel_ctx._launch import netif as _netif

    found = _netif.route_to("127.0.0.1", 29500)
    assert found is not None and found.address == "127.0.0.1" and found.is_loopback
    assert found.interface == _netif.interface_of("127.0.0.1") and found.interface
