"""Replica groups misused, as on several machines (`accel-ctx lighthouse`, then one `accel-ctx
launch --lighthouse HOST:PORT --replica-group I` per group; real processes on gloo): two groups
running another script or another model, a group that never arrives. Each ends with one clear
line, nothing hangs, and the group that is right keeps its training."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from .. import _launcher, _timeouts

pytest.importorskip("torchft", reason="replica groups need torchft (pip install 'accel-ctx[ft]')")

pytestmark = pytest.mark.usefixtures("_stop_launchers")
SCRIPT = _launcher.SCRIPTS / "replica_groups_misuse.py"
STEPS = 6


def _lighthouse(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[bytes], Path, str]:
    """`accel-ctx lighthouse --port 0 ARGS`, its log and the HOST:PORT it prints."""
    proc, log = _launcher.start(["--port", "0", *args], tmp_path, "lighthouse.log",
                                command="lighthouse")
    deadline = time.monotonic() + _timeouts.scaled(60)
    while time.monotonic() < deadline:
        found = re.search(r"listening at http://(\S+?);", log.read_text())
        if found:
            return proc, log, found[1]
        time.sleep(0.2)
    pytest.fail(f"no lighthouse address within 60 s (scaled)\n{log.read_text()}")


def _group(tmp_path: Path, address: str, group: int, script: Path, width: int = 16,
           groups: int = 2, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen[bytes], Path]:
    return _launcher.start(["-n", "1", *extra, "--lighthouse", address, "--replica-groups",
                            str(groups), "--replica-group", str(group), str(script),
                            str(tmp_path), str(STEPS), str(width)], tmp_path, f"group{group}.log",
                           fork_replica_workers=True)


def _stop_lighthouse(proc: subprocess.Popen[bytes], log: Path) -> None:
    proc.send_signal(signal.SIGTERM)
    assert _launcher.finish(proc, 60) == 0, log.read_text()


def _trained_alone_to_the_end(tmp_path: Path, text: str) -> dict:
    """Group 0's run: every step up to STEPS committed, in order, the last ones alone."""
    run = torch.load(tmp_path / "group0.pt")
    steps = [step for step, _ in run["seen"]]
    assert steps == list(range(steps[0], STEPS + 1)) and steps[0] <= 1, (steps, text)
    assert run["seen"][-1][1] == 1, text
    for key, value in run["weights"].items():
        assert torch.isfinite(value).all(), key
    return run


def _the_odd_group_stops_and_the_other_trains_on(tmp_path: Path, odd: Path, width: int,
                                                 why: str) -> None:
    lighthouse, lighthouse_log, address = _lighthouse(tmp_path)
    first, first_log = _group(tmp_path, address, 0, SCRIPT)
    second, second_log = _group(tmp_path, address, 1, odd, width, extra=("--max-restarts", "0"))
    codes = [_launcher.finish(first, 300), _launcher.finish(second, 300)]
    first_text, second_text = first_log.read_text(), second_log.read_text()
    text = f"--- group 0\n{first_text[-3000:]}\n--- group 1\n{second_text[-3000:]}"
    assert codes == [0, 1], text
    # the odd group (the later one, the two being tied) stops naming itself, the reference
    # group, the difference and the fix, before any gradient is mixed
    said = [line for line in second_text.splitlines()
            if line.startswith("accel_ctx.errors.ConfigurationError")]
    assert said == [f"accel_ctx.errors.ConfigurationError: replica group 1 runs {why} than "
                    "replica group 0: its gradients cannot be averaged with theirs. Start "
                    "every replica group with the same script, arguments and model."], text
    assert not (tmp_path / "group1.pt").exists()
    # the other one says why it left, drops that step everywhere, and trains on alone
    reason = f"replica group 1 runs {why.split(' (')[0]}"
    assert f"accel-ctx: replica group 1 left at step 0 ({reason}" in first_text, text
    assert "1 group goes on." in first_text, text
    assert "Traceback" not in first_text and "INFO" not in first_text, text
    _trained_alone_to_the_end(tmp_path, text)
    _stop_lighthouse(lighthouse, lighthouse_log)


def test_a_group_running_another_script_stops_naming_both_and_the_other_trains_on(
        tmp_path: Path) -> None:
    other = tmp_path / "other_train.py"  # a copy with one line changed
    other.write_text(SCRIPT.read_text().replace("lr=0.01", "lr=0.02"))
    _the_odd_group_stops_and_the_other_trains_on(
        tmp_path, other, 16, "another script (its file's contents differ)")


def test_a_group_training_another_model_stops_naming_the_sizes_and_the_other_trains_on(
        tmp_path: Path) -> None:
    # the same script, another width: 8*12+12 + 12+1 elements against 8*16+16 + 16+1
    _the_odd_group_stops_and_the_other_trains_on(
        tmp_path, SCRIPT, 12,
        "other trainable parameters (4 tensors, 121 elements, against 4 and 161)")


def _short_replica_timeout(monkeypatch: pytest.MonkeyPatch) -> str:
    """ACCEL_CTX_REPLICA_TIMEOUT for a test that waits one out (30 s by default: the same
    path, waited longer), scaled for a busy machine; the seconds as the messages say them."""
    seconds = f"{round(_timeouts.scaled(8))}"
    monkeypatch.setenv("ACCEL_CTX_REPLICA_TIMEOUT", seconds)
    return seconds


def test_a_group_that_never_arrives_is_named_and_the_others_train_without_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wait = _short_replica_timeout(monkeypatch)
    lighthouse, lighthouse_log, address = _lighthouse(tmp_path)
    first, first_log = _group(tmp_path, address, 0, SCRIPT)  # group 1 is never started
    code = _launcher.finish(first, 300)
    text = first_log.read_text()
    assert code == 0, text[-3000:]
    lines = [line for line in text.splitlines() if line.startswith("accel-ctx:")]
    assert lines == [f"accel-ctx: replica group 1 did not reach the lighthouse at "
                     f"http://{address} within {wait} s; 1 group goes on without it; it joins at "
                     "the current step when it arrives."], text[-3000:]
    run = _trained_alone_to_the_end(tmp_path, text)
    assert {groups for _, groups in run["seen"]} == {1}, text[-3000:]
    _stop_lighthouse(lighthouse, lighthouse_log)


def test_a_quorum_the_lighthouse_never_forms_ends_the_group_naming_min_replicas(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wait = _short_replica_timeout(monkeypatch)
    lighthouse, lighthouse_log, address = _lighthouse(tmp_path, "--min-replicas", "2")
    first, first_log = _group(tmp_path, address, 0, SCRIPT)  # the second group never comes
    code = _launcher.finish(first, 300)  # the quorum's timeout, not forever
    text = first_log.read_text()
    assert code == 1, text[-3000:]
    errors = [line for line in text.splitlines() if "Error: " in line]
    assert errors[-1] == (
        f"accel_ctx.errors.RendezvousError: replica group 0 reached the lighthouse at "
        f"http://{address}, but no quorum formed there within {wait} s: the lighthouse waits "
        "until its --min-replicas groups ask for one, and fewer did. Start the missing groups (this "
        "job has 2), or run `accel-ctx lighthouse` with a smaller --min-replicas."), text[-3000:]
    assert "cannot reach" not in text, text[-3000:]
    assert text.rstrip().splitlines()[-1].startswith("accel-ctx launch: rank 0"), text[-3000:]
    assert not (tmp_path / "group0.pt").exists()
    _stop_lighthouse(lighthouse, lighthouse_log)
