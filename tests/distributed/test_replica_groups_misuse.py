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
           groups: int = 2, extra: tuple[str, ...] = (), more: tuple[str, ...] = (),
           steps: int = STEPS, log: str = "", out: Path | None = None
           ) -> tuple[subprocess.Popen[bytes], Path]:
    return _launcher.start(["-n", "1", *extra, "--lighthouse", address, "--replica-groups",
                            str(groups), "--replica-group", str(group), str(script),
                            str(out or tmp_path), str(steps), str(width), *more], tmp_path,
                           log or f"group{group}.log", fork_replica_workers=True)


def _stop_lighthouse(proc: subprocess.Popen[bytes], log: Path) -> None:
    proc.send_signal(signal.SIGTERM)
    assert _launcher.finish(proc, 60) == 0, log.read_text()


def _trained_alone_to_the_end(tmp_path: Path, text: str) -> dict:
    """Group 0's run: every step up to STEPS committed, in order, the last ones alone (a step
    a refused group made fail is dropped in every group and taken again: recorded twice)."""
    run = torch.load(tmp_path / "group0.pt")
    steps = [step for step, _ in run["seen"]]
    assert steps == sorted(steps) and steps[0] <= 1, (steps, text)
    assert sorted(set(steps)) == list(range(steps[0], STEPS + 1)), (steps, text)
    assert len(steps) - len(set(steps)) <= 2, (steps, text)  # at most a refused group's steps
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
        "job has 2), or run `accel-ctx lighthouse` with a smaller --min-replicas. If nothing else "
        "should be missing, what answers at that address may not be a torchft lighthouse "
        "(another server on that port): check --lighthouse against the address `accel-ctx "
        "lighthouse` printed."), text[-3000:]
    assert "cannot reach" not in text, text[-3000:]
    assert text.rstrip().splitlines()[-1].startswith("accel-ctx launch: rank 0"), text[-3000:]
    assert not (tmp_path / "group0.pt").exists()
    _stop_lighthouse(lighthouse, lighthouse_log)


def test_groups_of_other_sizes_or_other_data_are_named_and_the_first_trains_on(
        tmp_path: Path) -> None:
    # Group 1 runs 2 processes where group 0 runs 1 (the multi-machine form with another -n):
    # one group said "start the missing groups", the other retried step 1 until killed. Group
    # 2 reads 40 samples where the others read 64: it trained to the end without a word. Each
    # now stops at its first step naming the difference; group 0 trains on.
    lighthouse, lighthouse_log, address = _lighthouse(tmp_path)
    first, first_log = _group(tmp_path, address, 0, SCRIPT, groups=3)
    wide, wide_log = _group(tmp_path, address, 1, SCRIPT, groups=3,
                            extra=("--max-restarts", "0", "-n", "2"))
    short, short_log = _group(tmp_path, address, 2, SCRIPT, groups=3,
                              extra=("--max-restarts", "0"), more=("40",))
    began = time.monotonic()
    codes = [_launcher.finish(wide, 300), _launcher.finish(short, 300)]
    took = time.monotonic() - began
    codes.append(_launcher.finish(first, 300))
    logs = [first_log.read_text(), wide_log.read_text(), short_log.read_text()]
    text = "\n".join(f"--- group {g}\n{t[-3000:]}" for g, t in enumerate(logs))
    assert codes == [1, 1, 0], text
    assert took < _timeouts.scaled(60), text  # within the first quorum's 30 s and a step
    errors = [[line.removeprefix("[rank0]: ") for line in t.splitlines()
               if line.removeprefix("[rank0]: ").startswith("accel_ctx.errors.")] for t in logs]
    assert errors[1][:1] == [
        "accel_ctx.errors.ConfigurationError: replica group 1 has 2 processes and replica group "
        "0 has 1: the groups average each rank's gradients with the same rank of the others, so "
        "every group needs as many. Start every group's launcher with the same -n (and "
        "--nnodes)."], text
    assert errors[2] == [
        "accel_ctx.errors.ConfigurationError: replica group 2 reads another data set than "
        "replica group 0 (its first DataLoader: 40 samples in batches of 4, against 64 in "
        "batches of 4): each group trains its share of one data set. Start every replica group "
        "with the same data and arguments."], text
    assert "did not reach" not in logs[0], text
    assert ("accel-ctx: replica group 1 has 2 processes and replica group 0 has 1: it is refused "
            "and stops; this job trains on without it.") in logs[0], text
    _trained_alone_to_the_end(tmp_path, text)
    _stop_lighthouse(lighthouse, lighthouse_log)


def test_two_jobs_at_one_lighthouse_as_the_same_group_are_told_and_one_trains_on(
        tmp_path: Path) -> None:
    # Two one-group jobs, each replica group 0, at one lighthouse: one lost a step amid C++
    # stack traces, the clash never named. Now the group that joined second (or, joining at
    # once, one of them) stops naming the clash and the fix; the other trains to the end.
    lighthouse, lighthouse_log, address = _lighthouse(tmp_path)
    jobs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        jobs.append(_group(tmp_path, address, 0, SCRIPT, groups=1, steps=40,
                           extra=("--max-restarts", "0"), log=f"{name}.log",
                           out=tmp_path / name))
    codes = [_launcher.finish(proc, 300) for proc, _ in jobs]
    logs = [log.read_text() for _, log in jobs]
    text = "\n".join(f"--- job {n}\n{t[-3000:]}" for n, t in zip("ab", logs, strict=True))
    assert sorted(codes) == [0, 1], text
    loser = codes.index(1)
    errors = [line for line in logs[loser].splitlines() if "Error: " in line]
    assert errors == [
        f"accel_ctx.errors.ConfigurationError: replica group 0 found another replica group 0 at "
        f"the lighthouse at http://{address}: two jobs share that lighthouse, or two groups of "
        "one job were started with the same --replica-group. Give each job its own lighthouse "
        "(`accel-ctx lighthouse` per job, or `accel-ctx launch --replica-groups R`, which starts "
        "one), and each group of a job its own --replica-group, 0 to R-1."], text
    for t in logs:
        assert "terminate called" not in t and "EnforceNotMet" not in t, text
    winner = torch.load(tmp_path / "ab"[1 - loser] / "group0.pt")
    assert winner["seen"][-1][0] == 40, text
    assert not (tmp_path / "ab"[loser] / "group0.pt").exists()
    _stop_lighthouse(lighthouse, lighthouse_log)
