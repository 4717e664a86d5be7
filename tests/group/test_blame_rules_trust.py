"""The blame rules and the launchers' summaries, without processes: records in, verdict out."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from accel_ctx._group import blame as _blame
from accel_ctx._job import progress as _progress
from accel_ctx.cli import describe_failure
from accel_ctx.errors import DistributedError


def _record(step: int, seq: int, phase: str, state: str = "running", **extra) -> dict:
    return {"step": step, "seq": seq, "phase": phase, "where": "train.py:7 in loop",
            "beat": 3, "pid": os.getpid(), "host": _progress.machine(), "state": state,
            "detail": "", "blames": [], **extra}


def _me(step: int, seq: int, phase: str) -> _progress.Progress:
    progress = _progress.Progress()
    progress.step, progress.seq, progress.phase = step, seq, phase
    return progress


def test_the_rank_behind_is_the_one_that_stopped_answering():
    records = {0: _record(5, 2, "backward"), 1: _record(5, 1, "forward"),
               2: _record(5, 2, "backward")}
    culprits, summary, _ = _blame._culprits(records, 0, _me(5, 2, "backward"), "backward", True)
    assert culprits == [1]
    assert summary == ("rank 1 stopped answering at step 5, in forward (at train.py:7 in loop); "
                       "rank 0 timed out waiting for it in backward")


def test_an_earlier_step_counts_before_the_phase():
    records = {0: _record(6, 1, "forward"), 1: _record(5, 3, "after optimizer step")}
    culprits, summary, _ = _blame._culprits(records, 0, _me(6, 1, "forward"), "forward", False)
    assert culprits == [1] and "at step 5, after optimizer step" in summary
    assert "lost the connection to it in forward" in summary


def test_no_rank_behind_gives_no_culprit():
    records = {0: _record(5, 2, "backward"), 1: _record(5, 2, "gather()")}
    assert _blame._culprits(records, 0, _me(5, 2, "backward"), "backward", True) is None


def test_a_rank_that_left_or_failed_comes_first():
    records = {0: _record(5, 2, "backward"), 1: _record(5, 1, "forward"),
               2: _record(4, 0, "after optimizer step", state="left")}
    culprits, summary, _ = _blame._culprits(records, 0, _me(5, 2, "backward"), "backward", False)
    assert culprits == [2] and summary.startswith("rank 2 left distributed() at step 4")
    records[1] = _record(5, 1, "forward", state="failed", detail="ValueError: boom")
    culprits, summary, _ = _blame._culprits(records, 0, _me(5, 2, "backward"), "backward", False)
    assert culprits == [1] and "rank 1 failed at step 5, in forward" in summary
    assert "ValueError: boom" in summary


def test_the_rank_a_failed_rank_blamed_is_named_also_when_it_is_this_one():
    records = {0: _record(5, 2, "backward", state="failed", blames=[1],
                          detail="rank 1 stopped answering at step 5, in forward"),
               1: _record(5, 1, "forward"), 2: _record(5, 2, "backward")}
    culprits, summary, _ = _blame._culprits(records, 2, _me(5, 2, "backward"), "backward", False)
    assert culprits == [1] and summary.endswith("(reported by rank 0)")
    culprits, summary, _ = _blame._culprits(records, 1, _me(5, 1, "forward"), "backward", False)
    assert culprits == [1] and summary.startswith("rank 0 gave up waiting for this rank")


def test_a_rank_whose_process_is_gone_is_named():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid is gone
    records = {0: _record(5, 2, "backward"), 1: _record(5, 2, "backward", pid=child.pid)}
    assert _progress.process_gone(records[1]) and not _progress.process_gone(records[0])
    culprits, summary, _ = _blame._culprits(records, 0, _me(5, 2, "backward"), "backward", False)
    assert culprits == [1] and summary.startswith("rank 1's process died (last seen at step 5")


def test_only_communication_failures_are_reinterpreted():
    assert _blame.looks_distributed(RuntimeError("[gloo] Connection closed by peer"))
    assert _blame.looks_distributed(RuntimeError("Timed out waiting 6000ms for recv"))
    assert not _blame.looks_distributed(RuntimeError("element 0 of tensors does not require grad"))
    assert not _blame.looks_distributed(ValueError("gloo"))
    assert not _blame.looks_distributed(DistributedError("rank 1 timed out"))


def test_the_error_file_is_whole_or_absent_never_cut_short(tmp_path, monkeypatch):
    """torchrun's agent reads a dead worker's error file and fails on a cut-short one (seen in
    CI: "Failed to parse reply file" ended a job that --max-restarts should have restarted)."""
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

    def killed_while_writing(data, f):  # type: ignore[no-untyped-def]
        f.write('{"message": {"mess')
        f.flush()
        raise OSError("the worker is killed here")

    monkeypatch.setattr(json, "dump", killed_while_writing)
    _blame.write_error_file(DistributedError("rank 0: rank 1 left"), 1, RuntimeError("gone"))
    assert not path.exists() and list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    _blame.write_error_file(DistributedError("rank 0: rank 1 left"), 1, RuntimeError("gone"))
    assert json.loads(path.read_text())["message"]["extraInfo"][_blame.CULPRIT_KEY] == 1
    assert list(tmp_path.iterdir()) == [path]


def test_accel_ctx_launch_names_the_culprit_from_the_error_file(tmp_path, monkeypatch):
    files = {r: tmp_path / f"error{r}.json" for r in (0, 1)}
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(files[0]))
    error = DistributedError("rank 0: rank 1 stopped answering at step 5, in forward")
    _blame.write_error_file(error, 1, RuntimeError("Timed out"))
    saved = json.loads(files[0].read_text())
    assert saved["message"]["extraInfo"][_blame.CULPRIT_KEY] == 1
    failures = {0: ProcessFailure(0, 100, 1, str(files[0])),
                1: ProcessFailure(1, 101, -9, str(files[1]))}  # killed by the launcher after
    text = describe_failure(ChildFailedError("train.py", failures), 0)
    assert "accel-ctx launch: rank 1 caused the failure (named by rank 0" in text
    assert "rank 1 stopped answering at step 5, in forward" in text
    plain = describe_failure(ChildFailedError("train.py", {1: failures[1]}), 0)
    assert "accel-ctx launch: rank 1 (local rank 1" in plain  # no accel_ctx error file


def test_the_line_shown_is_the_users_not_the_standard_librarys():
    import copy
    import sys

    seen: list[str] = []

    class Probe:
        def __deepcopy__(self, memo):
            seen.append(_progress._format(_progress._user_code_line(sys._getframe(1))))  # deepcopy
            return self

    def caller() -> None:
        copy.deepcopy(Probe())

    caller()
    assert seen == [f"test_blame_rules_trust.py:{caller.__code__.co_firstlineno + 1} in caller"]


def test_the_stalled_line_is_read_from_a_faulthandler_dump_of_that_thread_alone(tmp_path):
    """The heartbeat reads the training thread's line from faulthandler's dump (taken in C,
    under the GIL), never by walking a running thread's frames from Python, which crashed
    CPython 3.11 in a spawned rank (SIGSEGV in the heartbeat thread)."""
    import faulthandler
    import threading

    from accel_ctx._job.progress import thread_line

    def stuck_here(path):
        with open(path, "w+") as f:
            faulthandler.dump_traceback(f, all_threads=True)
            f.seek(0)
            return f.read()

    dump = stuck_here(tmp_path / "dump")
    line = thread_line(dump, threading.get_ident())
    assert line.startswith("test_blame_rules_trust.py:") and line.endswith("in stuck_here")
    assert thread_line(dump, 12345) == ""  # another thread's id: nothing of ours


def test_restarts_are_suggested_after_a_kill_not_after_the_scripts_own_exit_code():
    def last_line(code: int) -> str:
        failure = ProcessFailure(0, 100, code, "")
        return describe_failure(ChildFailedError("train.py", {0: failure}), 0).splitlines()[-1]

    assert "--max-restarts" not in last_line(3)  # sys.exit(3): the script's own choice
    assert "exited with code 3" in last_line(3)
    assert "--max-restarts" in last_line(-9)  # killed (out of memory)
    assert "--max-restarts" in last_line(128 + 15)  # resumable()'s exit after a SIGTERM


def test_a_live_rank_busy_outside_any_collective_is_the_one_waited_for():
    # a rank stalled inside save_state() (a write that hangs) stands at the same step as the
    # rank that timed out waiting for it: no rank was behind, and the message blamed no one
    records = {0: _record(6, 4, "after save_state()", waiting=False, blocked="all_gather"),
               1: _record(6, 4, "after save_state()", waiting=False, blocked="",
                          where="train.py:22 in write")}
    culprits, summary, advice = _blame.busy_elsewhere(records, 0, "save_state()")
    assert culprits == [1]
    assert summary == ("rank(s) [1] never came to the call: busy outside any collective (rank 1 "
                       "at step 6, after save_state() (at train.py:22 in write)) while rank 0 "
                       "timed out waiting in save_state()")
    assert "raise distributed(timeout=...)" in advice
    # a rank in a collective, in a wait of ours or in a backward (DDP waits inside the engine)
    # is not busy elsewhere
    for other in ({"blocked": "broadcast"}, {"waiting": True}, {"phase": "backward"}):
        records[1] = {**_record(6, 4, "after save_state()", waiting=False, blocked=""), **other}
        assert _blame.busy_elsewhere(records, 0, "save_state()") is None, other


def test_a_frozen_rank_is_placed_at_the_step_its_mirror_shows(tmp_path):
    # a process stopped (SIGSTOP) soon after a step leaves a record a few steps old: the
    # message said it stopped "at step 0, before any forward" when it was at step 3
    mirror = tmp_path / "mirror"
    mirror.write_bytes(_progress.MIRROR_STEP.pack(3))
    records = {0: _record(3, 2, "backward"),
               1: _record(0, 0, "before any forward", mirror=str(mirror))}
    culprits, summary, _ = _blame._culprits(records, 0, _me(3, 2, "backward"), "backward", True)
    assert culprits == [1]
    assert summary.startswith(
        "rank 1 stopped answering at step 3 (its last published record is from step 0)"), summary
