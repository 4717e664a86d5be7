"""The replica groups' launchers from start to end (issue 53), real launchers on gloo: nothing
outlives `accel-ctx launch --replica-groups R` (SIGKILL, SIGTERM), a group whose lighthouse is
gone ends naming it instead of restarting, a worker's failure is said once, and a script that
never opened distributed() is named instead of training R models apart."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from accel_ctx._launch import signals

from .. import _launcher, _timeouts

pytest.importorskip("torchft", reason="replica groups need torchft (pip install 'accel-ctx[ft]')")

LOOP = str(_launcher.SCRIPTS / "replica_launch_loop.py")
TRAIN = str(_launcher.SCRIPTS / "replica_groups_train.py")


@pytest.fixture(autouse=True)
def _stop_launchers(tmp_path: Path):
    """Whatever a test left running (it failed early) is stopped with its workers, and what
    outlived its launcher (each has the test's tmp_path in its command line)."""
    yield
    _launcher.stop_all()
    for pid in _of_the_job(str(tmp_path)):
        os.kill(pid, signal.SIGKILL)


def _of_the_job(marker: str) -> list[int]:
    """The live processes with ``marker`` (a test's tmp_path: long and unique) as an argument
    of their command line (launchers, workers)."""
    if len(marker) < 8 or "\0" in marker:  # never a pattern every command line has
        raise ValueError(f"not a unique marker: {marker!r}")
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            command = Path(f"/proc/{entry.name}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if any(marker in arg for arg in command.split("\0")) and _launcher.alive(
                int(entry.name)):
            found.append(int(entry.name))
    return found


def _wait_for(what: str, found, seconds: float, logs: list[Path]):
    """``found()``'s first true value within ``seconds`` (scaled); else fail with the logs."""
    deadline = time.monotonic() + _timeouts.scaled(seconds)
    while time.monotonic() < deadline:
        value = found()
        if value:
            return value
        time.sleep(0.2)
    text = "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}" for log in logs)
    pytest.fail(f"no {what} within {seconds} s (scaled)\n{text}")


def _step(path: Path) -> int:
    try:
        return int(path.read_text() or -1)
    except (FileNotFoundError, ValueError):
        return -1


def _training(tmp_path: Path, log: Path, groups: int = 2) -> None:
    _wait_for("step 2 in every group", lambda: all(
        _step(tmp_path / f"progress{g}-0") >= 2 for g in range(groups)), 240, [log])


def _listening(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp* write them) listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                found.append(local.rsplit(":", 1)[0])
    return found


def _all_in_one(tmp_path: Path) -> tuple:
    # a real interpreter for the launcher: its group launchers and their workers are its
    # descendants, each with tmp_path in its command line
    proc, log = _launcher.start(["-n", "1", "--replica-groups", "2", "--max-restarts", "3", LOOP,
                                 str(tmp_path), "0", "distributed"], tmp_path, "launch.log",
                                fresh_launcher=True)
    _training(tmp_path, log)
    assert len(_of_the_job(str(tmp_path))) >= 5, log.read_text()  # 1 + 2 launchers + 2 workers
    return proc, log


def test_a_killed_all_in_one_launcher_leaves_nothing_and_its_lighthouse_was_on_loopback(
        tmp_path: Path) -> None:
    proc, log = _all_in_one(tmp_path)
    host, port = re.search(r"lighthouse at http://(\S+):(\d+)", log.read_text()).groups()
    listening = _listening(int(port))
    proc.send_signal(signal.SIGKILL)  # the launcher alone, as the OOM killer would
    proc.wait()
    # its group launchers were told (SIGTERM, by the kernel) and stopped their workers
    _wait_for("end of every launcher and worker", lambda: not _of_the_job(str(tmp_path)), 20,
              [log])
    # the lighthouse listened on loopback only: 127.0.0.1 (0100007F in /proc/net/tcp), not on
    # every interface (00000000, or :: in tcp6), and its groups dialled that address
    assert (host, listening) == ("127.0.0.1", ["0100007F"]), log.read_text()


def _group_of(pid: int) -> str | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    found = [v for v in environ if v.startswith(b"REPLICA_GROUP_ID=")]
    return found[0].split(b"=", 1)[1].decode() if found else None


def test_a_group_launcher_killed_by_sigkill_takes_its_workers_with_it(tmp_path: Path) -> None:
    # torchrun's agent, SIGKILLed, tells its workers nothing: they trained on as orphans in the
    # other groups' quorums after their group was reported gone
    proc, log = _all_in_one(tmp_path)
    launchers = [p for p in signals.children_of(proc.pid) if _group_of(p) is not None]
    group1 = next(p for p in launchers if _group_of(p) == "1")
    workers = [p for p in _of_the_job(str(tmp_path))
               if _group_of(p) == "1" and p != group1 and p not in launchers]
    assert workers, log.read_text()
    os.kill(group1, signal.SIGKILL)
    _wait_for("the end of the killed group's workers",
              lambda: not any(_launcher.alive(p) for p in workers), 30, [log])
    _wait_for("the launcher's line", lambda: "replica group 1 ended" in log.read_text(), 30,
              [log])
    proc.send_signal(signal.SIGTERM)  # group 0 trains on until it is stopped
    _launcher.finish(proc, 90)


def test_sigterm_to_the_all_in_one_launcher_ends_every_group_cleanly(tmp_path: Path) -> None:
    proc, log = _all_in_one(tmp_path)
    proc.send_signal(signal.SIGTERM)  # the launcher alone (a scheduler's stop)
    code = _launcher.finish(proc, 90)
    text = log.read_text()
    assert code == 128 + signal.SIGTERM, text
    assert text.rstrip().splitlines()[-1] == (
        "accel-ctx launch: stopped by SIGTERM; every replica group was stopped."), text
    time.sleep(1)  # a worker's last exit is reaped by its launcher before that one ends
    assert not _of_the_job(str(tmp_path)), text


def _lighthouse(tmp_path: Path) -> tuple:
    proc, log = _launcher.start(["--port", "0"], tmp_path, "lighthouse.log",
                                command="lighthouse", fresh_launcher=True)
    address = _wait_for("lighthouse address", lambda: re.search(
        r"listening at http://(\S+?);", log.read_text()), 60, [log])[1]
    return proc, log, address


def test_a_group_whose_lighthouse_dies_ends_naming_it_within_the_timeout_without_restarts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seconds = round(_timeouts.scaled(8))
    monkeypatch.setenv("ACCEL_CTX_REPLICA_TIMEOUT", str(seconds))
    lighthouse, _, address = _lighthouse(tmp_path)
    group, log = _launcher.start(["-n", "1", "--lighthouse", address, "--replica-group", "0",
                                  "--max-restarts", "3", LOOP, str(tmp_path), "0",
                                  "distributed"], tmp_path, "group0.log")
    _training(tmp_path, log, groups=1)
    lighthouse.send_signal(signal.SIGKILL)  # its machine is gone
    lost = time.monotonic()
    code = _launcher.finish(group, 120)
    took = time.monotonic() - lost
    text = log.read_text()
    assert code == 1, text
    assert (f"accel-ctx launch: replica group 0 lost its lighthouse at http://{address}: it has "
            f"not answered for {seconds} s (ACCEL_CTX_REPLICA_TIMEOUT), so the group's workers "
            "were stopped, not restarted") in text, text
    assert "restarts its workers" not in text and "failed (exitcode" not in text, text
    # the timeout, and the stop of its worker: not a restart after restart, each waiting it
    assert took < seconds + _timeouts.scaled(25), (took, text)


def test_a_killed_worker_is_said_once_and_a_script_with_distributed_ends_0(
        tmp_path: Path) -> None:
    # The normal half of the check below (a worker that opened distributed() marks joined-<rank>
    # in ACCEL_CTX_REPLICA_MARKS): that mark is written by the replica runtime (commit c68d69e).
    proc, log = _launcher.start(["-n", "1", "--replica-groups", "2", "--max-restarts", "3", TRAIN,
                                 str(tmp_path), "8", "2", "1", "3"], tmp_path, "launch.log")
    code = _launcher.finish(proc, 300)
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert "failed (exitcode" not in text, text[-3000:]  # torchrun's line: ours says it
    said = [line for line in text.splitlines() if "was killed by signal" in line]
    # the kill, said once (a later failure of the healed group, a loaded machine's, would be
    # said in its own line, restart 2 of 3)
    assert said and re.fullmatch(
        r"accel-ctx launch: rank 0 of replica group 1 \(local rank 0, pid \d+\) was killed by "
        r"signal SIGKILL; the group restarts its workers \(restart 1 of 3\), which heal from a "
        r"live group\.", said[0]), text[-3000:]
    assert not any("SIGKILL" in line for line in said[1:]), text[-3000:]
    assert "trained on its own" not in text, text[-3000:]


def test_a_script_that_never_opens_distributed_is_named_not_trained_apart(
        tmp_path: Path) -> None:
    proc, log = _launcher.start(["-n", "1", "--replica-groups", "2", LOOP, str(tmp_path), "3",
                                 "plain"], tmp_path, "launch.log")
    code = _launcher.finish(proc, 120)
    text = log.read_text()
    assert code == 1, text
    for group in (0, 1):
        assert (f"accel-ctx launch: replica group {group} trained on its own: the script never "
                "opened distributed() (or sharded()), so its workers never met the other "
                "replica groups, and each group trained a model of its own. Wrap the training "
                "loop in `with distributed():`") in text, text
    assert _step(tmp_path / "progress0-0") == 3, text  # it did train, alone
