"""Replica groups whose launchers start on their own, as on several machines: `accel-ctx
lighthouse`, then `accel-ctx launch --lighthouse HOST:PORT --replica-group I` per group (real
processes on gloo, on this machine)."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest
import torch

from .. import _launcher, _timeouts

pytest.importorskip("torchft", reason="replica groups need torchft (pip install 'accel-ctx[ft]')")

pytestmark = pytest.mark.usefixtures("_stop_launchers")
SCRIPT = str(_launcher.SCRIPTS / "replica_groups_join.py")


def _wait_for(what: str, found, seconds: float, logs: list[Path]):
    """``found()``'s first true value within ``seconds`` (scaled); else fail with the logs."""
    deadline = time.monotonic() + _timeouts.scaled(seconds)
    while time.monotonic() < deadline:
        value = found()
        if value:
            return value
        time.sleep(0.2)
    text = "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-2000:]}" for log in logs)
    pytest.fail(f"no {what} within {seconds} s (scaled)\n{text}")


def _step(path: Path) -> int:
    try:
        return int(path.read_text() or -1)
    except (FileNotFoundError, ValueError):
        return -1


def test_a_group_started_later_joins_the_live_job_at_its_step_through_a_lighthouse(
        tmp_path: Path) -> None:
    lighthouse, lighthouse_log = _launcher.start(["--port", "0"], tmp_path, "lighthouse.log",
                                                 command="lighthouse")
    address = _wait_for("lighthouse address", lambda: re.search(
        r"listening at (http://\S+?);", lighthouse_log.read_text()), 60, [lighthouse_log])[1]
    group = ["-n", "1", "--lighthouse", address, "--replica-groups", "2", "--replica-group"]
    first, first_log = _launcher.start([*group, "0", SCRIPT, str(tmp_path), "12", "2"],
                                       tmp_path, "group0.log", fork_replica_workers=True)
    logs = [lighthouse_log, first_log]
    _wait_for("step 3 of group 0", lambda: _step(tmp_path / "progress0") >= 3, 240, logs)
    second, second_log = _launcher.start([*group, "1", SCRIPT, str(tmp_path), "12", "2"],
                                         tmp_path, "group1.log", fork_replica_workers=True)
    logs.append(second_log)
    codes = [_launcher.finish(first, 400), _launcher.finish(second, 400)]
    text = "\n".join(log.read_text(errors="replace")[-3000:] for log in logs)
    assert codes == [0, 0], text
    live = torch.load(tmp_path / "group0.pt")
    joined = torch.load(tmp_path / "group1.pt")
    assert [n for _, n in live["seen"]][:3] == [1, 1, 1], text  # group 0 began alone
    assert joined["seen"][0][0] > 3, text  # group 1 began at the live job's step, not at 0
    assert live["seen"][-3:] == joined["seen"][-3:], text  # 3 steps together, to one end
    assert [n for _, n in joined["seen"][-3:]] == [2, 2, 2], text
    assert live["seen"][-1][0] >= 12
    for key, value in live["weights"].items():
        assert torch.equal(value, joined["weights"][key]), key
    lighthouse.send_signal(signal.SIGTERM)
    assert _launcher.finish(lighthouse, 60) == 0, lighthouse_log.read_text()
    assert "stopped by SIGTERM" in lighthouse_log.read_text()


def test_a_group_whose_lighthouse_never_answers_says_so_within_its_timeout_and_starts_no_worker(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    monkeypatch.setenv("ACCEL_CTX_REPLICA_TIMEOUT", "3")  # 30 s by default: the same path

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc, log = _launcher.start(["-n", "1", "--lighthouse", f"127.0.0.1:{port}",
                                 "--replica-group", "0", SCRIPT, str(tmp_path), "3", "1"],
                                tmp_path, "launch.log")
    assert _launcher.finish(proc, 90) == 1
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    assert lines == [f"accel-ctx launch: cannot reach the replica groups' lighthouse at "
                     f"http://127.0.0.1:{port} within 3 s (Connection refused). Start "
                     f"`accel-ctx lighthouse --port {port}` on 127.0.0.1 first, or check "
                     "--lighthouse (the host and port it printed)."], lines
    assert not (tmp_path / "progress0").exists()  # no worker started
