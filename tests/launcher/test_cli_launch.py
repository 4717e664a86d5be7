"""`accel-ctx launch` for real: two nodes on one machine, a killed rank, restarts, a lost node.

Every command runs with a timeout; past it the launcher gets SIGTERM (torchrun then stops its
workers) and, if that is not enough, SIGKILL, so a test can fail but never hang.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from .. import _launcher
from .._launcher import SCRIPTS, alive, finish, stop, stop_all
from .._spawn import free_port
from .._timeouts import hint, scaled
from ..workers.common import params, train


def start(args: list[str], tmp_path: Path, log: str, **options: Any
          ) -> tuple[subprocess.Popen[bytes], Path]:
    """The launcher with real interpreters as workers (torchrun's own way), not forks of
    tests/_zygote.py's server: this module is where the plain path is checked."""
    return _launcher.start(args, tmp_path, log, fresh_workers=True, **options)


pytestmark = pytest.mark.slow

BATCH = 8


@pytest.fixture(autouse=True)
def _no_job_left_behind():
    yield
    stop_all()


def _wait_for(paths: list[Path], proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + scaled(timeout)
    while not all(p.exists() for p in paths):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            pytest.fail(f"the workers never started: {[p.name for p in paths]} missing; "
                        f"{hint()}")
        time.sleep(0.1)


def test_two_launchers_with_nnodes_2_form_one_world_of_4_and_train_equivalently(tmp_path):
    out = tmp_path / "params"
    out.mkdir()
    master = f"127.0.0.1:{free_port()}"
    script = [str(SCRIPTS / "train_save.py"), str(out), str(BATCH)]
    nodes = [
        start(["--nnodes", "2", "--node-rank", str(node), "--master", master, "-n", "2",
                "--rdzv-conf", f"join_timeout={scaled(60):.0f}", *script], tmp_path, f"node{node}.log")
        for node in (1, 0)  # the second node may start first
    ]
    codes = [finish(proc, 150) for proc, _ in nodes]
    logs = "\n".join(path.read_text() for _, path in nodes)
    assert codes == [0, 0], logs
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(4)]
    assert [r["world_size"] for r in ranks] == [4] * 4
    assert sorted(r["local_rank"] for r in ranks) == [0, 0, 1, 1]
    assert all(r["local_world_size"] == 2 and r["master_addr"] == "127.0.0.1" for r in ranks)
    reference = params(train("mlp", 4 * BATCH))
    for r in ranks:
        for key in reference:
            torch.testing.assert_close(r["params"][key], reference[key], rtol=1e-5, atol=1e-6)


def test_a_killed_rank_ends_the_job_within_seconds_naming_it(tmp_path):
    proc, log = start(["-n", "2", str(SCRIPTS / "crash.py"), str(tmp_path)], tmp_path, "job.log")
    pid_files = [tmp_path / f"pid.0.{r}" for r in range(2)]
    _wait_for(pid_files, proc, 120)
    pids = [int(p.read_text()) for p in pid_files]
    os.kill(pids[1], signal.SIGKILL)
    killed_at = time.monotonic()
    code = finish(proc, 60)
    elapsed = time.monotonic() - killed_at
    text = log.read_text()
    assert code != 0 and elapsed < scaled(30), text
    assert "rank 1 (local rank 1" in text and "SIGKILL" in text and "--max-restarts" in text
    assert not alive(pids[0])  # the surviving rank was stopped too
    assert not list(tmp_path.glob("done.*"))


def test_max_restarts_restarts_the_workers_and_the_job_completes(tmp_path):
    proc, log = start(["-n", "2", "--max-restarts", "1", "--mixed-precision", "bf16",
                        str(SCRIPTS / "crash.py"), str(tmp_path)], tmp_path, "job.log")
    _wait_for([tmp_path / f"pid.0.{r}" for r in range(2)], proc, 120)
    os.kill(int((tmp_path / "pid.0.1").read_text()), signal.SIGKILL)
    code = finish(proc, 150)
    assert code == 0, log.read_text()
    assert all((tmp_path / f"pid.1.{r}").exists() for r in range(2))  # a second attempt ran
    for r in range(2):
        done = json.loads((tmp_path / f"done.{r}").read_text())
        assert done == {"steps": 5, "precision": "bf16"}  # the flag reached distributed()


def test_a_node_that_never_comes_fails_within_the_rendezvous_timeout(tmp_path):
    began = time.monotonic()
    proc, log = start(["--nnodes", "2", "--node-rank", "0", "--master",
                        f"127.0.0.1:{free_port()}", "--rdzv-conf", "join_timeout=3", "-n", "1",
                        str(SCRIPTS / "crash.py"), str(tmp_path)], tmp_path, "job.log")
    code = finish(proc, 90)
    text = log.read_text()
    assert code == 1 and time.monotonic() - began < scaled(60), text
    assert "rendezvous at 127.0.0.1" in text and "did not complete with 2 node(s)" in text
    assert "join_timeout" in text
    assert not list(tmp_path.glob("pid.*"))  # no worker ever started


def test_the_script_gets_its_own_flags_and_a_missing_one_stops_before_torchrun(tmp_path):
    # each of these begins like a torchrun option: argparse called them ambiguous
    own = ["--log", "x", "--run", "y", "--max", "1", "--node", "2", "--local", "3", "--start",
           "4", "--nproc-per-node", "9"]
    (tmp_path / "show_argv.py").write_text(
        "import json, sys\njson.dump(sys.argv[1:], open('argv.json', 'w'))\n")
    proc, log = start(["-n", "1", "show_argv.py", *own], tmp_path, "own.log")
    assert finish(proc, 120) == 0, log.read_text()
    assert json.loads((tmp_path / "argv.json").read_text()) == own
    proc, log = start(["-n", "2", "missing.py"], tmp_path, "missing.log")
    code = finish(proc, 120)
    text = log.read_text()
    assert code == 2 and "accel-ctx launch: script 'missing.py' does not exist" in text, text
    assert "FAILED" not in text and "--max-restarts" not in text, text  # torchrun never ran
