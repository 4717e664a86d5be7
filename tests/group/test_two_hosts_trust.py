"""Issue 11 point 20: two real hosts. Two network namespaces joined by a veth pair
(10.77.0.1 and 10.77.0.2) stand for two machines whose host name resolves to loopback, as in
many containers; one `accel-ctx launch --nnodes 2` runs in each.

Needs root and `ip netns` (iproute2); skipped otherwise, with the reason. Only addresses in
10.77.0.0/24 inside the namespaces made here, and loopback, are used; the namespaces (and
with them the veth pair) are deleted in a finally, and every launcher is killed with its
workers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .._launcher import SCRIPTS, start, stop, stop_all
from .._timeouts import hint, scaled
from ..workers.common import params, train

pytestmark = pytest.mark.slow

BATCH = 8
HOSTS = ("10.77.0.1", "10.77.0.2")


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_hosts():
    """Two namespaces [(name, veth)], node 0 at 10.77.0.1 and node 1 at 10.77.0.2."""
    if sys.platform != "linux" or os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs Linux, root and `ip` (iproute2) to build two network namespaces")
    tag = f"acx{os.getpid() % 10_000_000}"
    hosts = [(f"{tag}n0", f"{tag}v0"), (f"{tag}n1", f"{tag}v1")]
    made: list[str] = []
    try:
        for ns, _ in hosts:
            result = _ip("netns", "add", ns)
            if result.returncode != 0:
                pytest.skip(f"`ip netns add` fails here: {result.stderr.strip()}")
            made.append(ns)
        steps = [("link", "add", hosts[0][1], "type", "veth", "peer", "name", hosts[1][1])]
        for (ns, veth), addr in zip(hosts, HOSTS, strict=True):
            steps += [("link", "set", veth, "netns", ns),
                      ("-n", ns, "addr", "add", f"{addr}/24", "dev", veth),
                      ("-n", ns, "link", "set", "lo", "up"),
                      ("-n", ns, "link", "set", veth, "up")]
        for step in steps:
            result = _ip(*step)
            if result.returncode != 0:
                pytest.skip(f"`ip {' '.join(step)}` fails here: {result.stderr.strip()}")
        yield hosts
    finally:
        for ns in made:
            _ip("netns", "del", ns)  # takes its end of the veth pair, and so the pair, along
        if made:
            _ip("link", "del", hosts[0][1])  # still in this namespace if a step failed early


def _start(ns: str, args: list[str], tmp_path: Path, log: str
           ) -> tuple[subprocess.Popen[bytes], Path]:
    return start(args, tmp_path, log, prefix=("ip", "netns", "exec", ns),
                 drop=("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT"))


def _finish_all(procs: list[subprocess.Popen[bytes]], timeout: float) -> list[int | None]:
    codes: list[int | None] = []
    try:
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=scaled(timeout)))
            except subprocess.TimeoutExpired:
                codes.append(None)  # hung: reported by the caller's assert
    finally:
        for proc in procs:
            stop(proc, grace=30)
    return codes


@pytest.fixture(autouse=True)
def _no_job_left_behind():
    yield
    stop_all()


def test_two_hosts_whose_names_resolve_to_loopback_train_as_one_process(two_hosts, tmp_path):
    out = tmp_path / "params"
    out.mkdir()
    master = f"{HOSTS[0]}:29531"  # a fresh namespace: every port is free there
    script = [str(SCRIPTS / "train_save.py"), str(out), str(BATCH)]
    procs, logs = [], []
    for node in (1, 0):  # the second node may start first
        proc, log = _start(two_hosts[node][0], [
            "--nnodes", "2", "--node-rank", str(node), "--master", master, "-n", "1",
            "--rdzv-conf", f"join_timeout={scaled(60):.0f}", *script], tmp_path, f"node{node}.log")
        procs.append(proc)
        logs.append(log)
    codes = _finish_all(procs, 150)
    text = "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs)
    assert codes == [0, 0], text + (f"\n{hint()}" if None in codes else "")
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    # the workers met at one node's own address, never at a host name or loopback
    assert ranks[0]["master_addr"] == ranks[1]["master_addr"] in HOSTS
    assert {r["gloo_ifname"] for r in ranks} == {veth for _, veth in two_hosts}
    reference = params(train("mlp", 2 * BATCH))
    for r in ranks:
        for key in reference:
            torch.testing.assert_close(r["params"][key], reference[key], rtol=1e-5, atol=1e-6)


def test_nodes_that_cannot_meet_say_which_address_each_side_tried(two_hosts, tmp_path):
    # node 0 waits for a node 1 that never comes; node 1 dials a port where nobody listens
    zero, zero_log = _start(two_hosts[0][0], [
        "--nnodes", "2", "--node-rank", "0", "--master", f"{HOSTS[0]}:29532", "-n", "1",
        "--rdzv-conf", "join_timeout=3", str(SCRIPTS / "crash.py"), str(tmp_path)],
        tmp_path, "node0.log")
    one, one_log = _start(two_hosts[1][0], [
        "--nnodes", "2", "--node-rank", "1", "--master", f"{HOSTS[0]}:29533", "-n", "1",
        "--rdzv-conf", "join_timeout=3,read_timeout=3", str(SCRIPTS / "crash.py"),
        str(tmp_path)], tmp_path, "node1.log")
    codes = _finish_all([zero, one], 90)
    texts = [zero_log.read_text(), one_log.read_text()]
    assert codes == [1, 1], (texts, hint() if None in codes else "")
    for node, text in enumerate(texts):
        veth = two_hosts[node][1]
        assert (f"This node (node rank {node}) reaches the master {HOSTS[0]}:2953{2 + node} "
                f"from {HOSTS[node]} (interface {veth}), advertised {HOSTS[node]}") in text, text
    assert not list(tmp_path.glob("pid.*"))  # no worker ever started
