"""resumable() across elastic launcher "nodes": two of them, one lost for good. The longest
launcher run of resumable()'s tests, apart from tests/resumable/test_resumable.py (whose helpers it uses)
so that the suite's two workers share the launcher runs.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path

import pytest

from .. import _launcher
from .._timeouts import scaled
from .test_resumable import (  # noqa: F401  (_stop_launchers: the autouse fixture, here too)
    SCRIPT,
    _final,
    _losses,
    _same,
    _stop_launchers,
)


# ---- elastic: two launcher "nodes", one lost for good ------------------------------------------
def _descendants(pid: int) -> list[int]:
    """The processes under ``pid`` (torchrun's workers run in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


@pytest.mark.slow
def test_two_elastic_nodes_one_lost_for_good_the_other_goes_on_from_the_last_checkpoint(
        tmp_path, monkeypatch):
    """`--nnodes 1:2`: 2 launchers of 2 processes train as one world of 4; the second launcher
    and its workers are SIGKILLed for good. The first restarts its workers, torchrun's
    rendezvous closes with the one node left, and the run continues on 2 processes from the
    last checkpoint (written by 4, mid-epoch), the data that epoch had not seen split between
    them, and rank 0 says so. It ends exactly as a run stopped at that checkpoint on 4
    processes and continued on 2 by hand (bit for bit: the same W -> W' switch)."""
    from .._spawn import free_port

    monkeypatch.setenv("STEP_SLEEP", "0.05")
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    master = f"127.0.0.1:{free_port()}"
    # last_call_timeout: how long a node that joined the rendezvous waits for the other before
    # it closes without it: the two launchers start together (a second apart at most), and
    # after the loss node 0 waits it out. keep_alive_*: the lost node's rendezvous entry goes
    # after 5 s without a heartbeat (torch's default: 15 s), node 0 then joins a new round.
    conf = (f"join_timeout={scaled(120):.0f},last_call_timeout={scaled(10):.0f},"
            f"keep_alive_interval=1,keep_alive_max_attempt={max(5, round(scaled(5)))}")
    nodes = [_launcher.start(["--nnodes", "1:2", "--node-rank", str(node), "--master", master,
                              "-n", "2", "--max-restarts", "3", "--rdzv-conf", conf, SCRIPT,
                              str(ckpt), str(out), "5"], tmp_path, f"node{node}.log",
                             fresh_launcher=True)  # its workers are its descendants
             for node in (0, 1)]
    deadline = time.monotonic() + scaled(180)
    while time.monotonic() < deadline and nodes[0][0].poll() is None and not list(
            ckpt.glob("ckpt-*-step5")):  # a save of the world of 4, published
        time.sleep(0.02)
    assert any(s == 5 for s, _, _ in _losses(out, 3)), nodes[0][1].read_text()[-6000:]
    lost, _ = nodes[1]
    doomed = [lost.pid, *_descendants(lost.pid)]
    for pid in doomed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    lost.wait()
    # The same switch made by hand: 4 processes stopped at the checkpoint node 0 resumes from,
    # 2 continuing from it. Made while node 0 waits out its rendezvous' last call for the lost
    # node, from the newest checkpoint now (node 0's workers fail in their next collective),
    # and again further down should node 0 have resumed from another one.
    monkeypatch.delenv("STEP_SLEEP")  # only the nodes' kill needed slow steps
    guess = max(int(p.name.rsplit("step", 1)[1]) for p in ckpt.glob("ckpt-*-step*"))
    by_hand_out = _by_hand(tmp_path, guess, monkeypatch)
    code = _launcher.finish(nodes[0][0], 300)
    text = nodes[0][1].read_text()
    assert code == 0, text[-6000:]
    resumed = re.search(r"resuming from (ckpt-\d+-step(\d+)) .*; resumed on 2 processes, the "
                        r"checkpoint was written by 4", text)
    assert resumed, text[-6000:]
    step = int(resumed[2])
    assert step in (5, 10, 15), step  # mid-epoch: 6 steps an epoch on 4, 12 on 2
    finals = [_final(out, rank) for rank in range(2)]
    assert [f["world"] for f in finals] == [2, 2] and not (out / "final.rank2.pt").exists()
    if step != guess:
        by_hand_out = _by_hand(tmp_path, step, monkeypatch)
    for rank in range(2):
        _same(finals[rank], _final(by_hand_out, rank))
        want = {s: loss for s, loss, _ in _losses(by_hand_out, rank)}
        got = {s: loss for s, loss, _ in _losses(out, rank)}  # steps run again: the last time
        assert got == want


def _by_hand(tmp_path: Path, step: int, monkeypatch: pytest.MonkeyPatch) -> Path:
    """4 processes stopped at ``step``'s checkpoint, then 2 continuing from it: the output."""
    ckpt, out = tmp_path / f"by-hand-{step}", tmp_path / f"by-hand-{step}-out"
    out.mkdir()
    for n in (4, 2):
        with monkeypatch.context() as env:
            if n == 4:
                env.setenv("STOP_AT", str(step))
            proc, log = _launcher.start(["-n", str(n), SCRIPT, str(ckpt), str(out), "5"],
                                        tmp_path, f"by-hand-{step}-{n}.log")
        assert _launcher.finish(proc, 240) == 0, log.read_text()[-6000:]
    return out
