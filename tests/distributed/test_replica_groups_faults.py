"""Replica groups under the faults a cluster makes (`accel-ctx launch --replica-groups`, torchft,
real processes on gloo): a group frozen past the lighthouse's heartbeat (SIGSTOP, then SIGCONT
while its peer trains), a group whose own loop ends before the others'."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from .. import _launcher

pytest.importorskip("torchft", reason="replica groups need torchft (pip install 'accel-ctx[ft]')")

pytestmark = pytest.mark.usefixtures("_stop_launchers")
SCRIPT = str(_launcher.SCRIPTS / "replica_faults_train.py")


def _runs(tmp_path: Path, groups: int) -> list[dict[str, Any]]:
    return [torch.load(tmp_path / f"group{g}-rank0.pt") for g in range(groups)]


def _committed(run: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Each committed step's record (a step taken again after a drop records its step again)."""
    return {record["step"]: record for record in run["seen"]}


def _launch(tmp_path: Path, *faults: str, steps: int = 30) -> str:
    """Two groups of one process under ``faults`` (the script's); the launcher's output, after
    checking that it ended 0 and that no collective was mismatched."""
    proc, log = _launcher.start(
        ["-n", "1", "--replica-groups", "2", "--max-restarts", "2", SCRIPT, str(tmp_path),
         str(steps), "2", *faults], tmp_path, "launch.log", fork_replica_workers=True)
    code = _launcher.finish(proc, 300)
    text = log.read_text(errors="replace")
    assert code == 0, text[-3000:]
    assert "mismatch" not in text and "EnforceNotMet" not in text, text[-3000:]
    return text


def _in_order(run: dict[str, Any]) -> list[int]:
    """The steps the run recorded: every step from 1 on, in order (a dropped step is taken
    again, so it may be recorded twice), none skipped."""
    steps = [r["step"] for r in run["seen"]]
    assert steps == sorted(steps) and set(steps) >= set(range(steps[0], steps[-1] + 1)), steps
    return steps


def _said(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("accel-ctx: ")]


def test_a_frozen_group_is_dropped_rejoins_and_heals_and_one_that_finishes_says_so(
        tmp_path: Path) -> None:
    # Group 1 stops itself (SIGSTOP) for 5 s after step 4, past the lighthouse's 2 s heartbeat:
    # group 0 goes on alone; woken, group 1 kept its torchft identity and never saw itself
    # leave. It used to skip the check of script and model its peer ran at the new quorum and
    # send its gradients into it: gloo's "collective mismatch" aborted the *healthy* group,
    # which restarted. Then group 1's loop ends at step 24 (its own bound) while group 0 goes
    # on to 30: group 0 used to report it as a failure ("stopped answering the lighthouse").
    text = _launch(tmp_path, "freeze:1:4:5", "end:1:24")
    healthy, woken = _runs(tmp_path, 2)
    # neither restarted: the healthy group's one worker trained every step, in order, to 30
    assert (healthy["restart"], woken["restart"]) == (0, 0), text[-3000:]
    steps = [r["step"] for r in healthy["seen"]]
    assert steps == sorted(steps) and set(steps) == set(range(1, 31)), text[-3000:]
    # the woken group was left out after step 4 and came back at the live step, healed
    back = woken["seen"][4]["step"]
    assert [r["step"] for r in woken["seen"][:4]] == [1, 2, 3, 4] and back > 5, text[-3000:]
    lines = _said(text)
    said = [
        "accel-ctx: replica group 1 left at step 4 (it stopped answering the lighthouse); 1 "
        "group goes on.",
        f"accel-ctx: replica group 1 joined at step {back - 1}; 2 groups train. Its share of "
        f"the {back - 5} steps taken without it was not trained ({(back - 5) * 4} samples).",
        "accel-ctx: replica group 1 was left out of the job after step 4: it did not ask the "
        "lighthouse for a quorum within its heartbeat timeout (it was stopped, paused or slowed "
        f"down) and the others went on without it; it rejoins at step {back - 1}, 2 groups "
        "train.",
        "accel-ctx: replica group 1 finished at step 24; 1 group goes on (the step under way is "
        "taken again, with the next batch, without it).",
    ]
    for line in said:
        assert line in lines, (line, text[-3000:])
    assert any(line.startswith(f"accel-ctx: replica group 1 healed from replica group 0 at step "
                               f"{back - 1} in ") for line in lines), text[-3000:]
    assert len(lines) == 5, text[-3000:]  # nothing else: no failure said of the finish
    # from its return on the two groups train in step: equal weights, other samples
    mine, theirs = _committed(woken), _committed(healthy)
    for step in range(back, 25):
        assert mine[step]["groups"] == theirs[step]["groups"] == 2, step
        assert mine[step]["sum"] == theirs[step]["sum"], step
        assert not set(mine[step]["samples"]) & set(theirs[step]["samples"]), step
    assert [r["groups"] for r in healthy["seen"] if r["step"] > 24] == [1] * 6, text[-3000:]
    assert woken["entry"]["step"] == 0  # state() at the scope's entry: before any quorum


def test_a_group_frozen_for_20_s_is_dropped_and_heals_when_it_wakes_its_peer_never_stops(
        tmp_path: Path) -> None:
    # 20 s: ten heartbeat timeouts, and dozens of the healthy group's steps alone
    text = _launch(tmp_path, "freeze:1:4:20")
    healthy, woken = _runs(tmp_path, 2)
    assert (healthy["restart"], woken["restart"]) == (0, 0), text[-3000:]
    assert _in_order(healthy)[0] == 1
    back = woken["seen"][4]["step"]
    assert [r["step"] for r in woken["seen"][:4]] == [1, 2, 3, 4] and back > 20, text[-3000:]
    lines = _said(text)
    assert ("accel-ctx: replica group 1 left at step 4 (it stopped answering the lighthouse); "
            "1 group goes on.") in lines, text[-3000:]
    assert any(line.startswith("accel-ctx: replica group 1 was left out of the job after step "
                               "4:") for line in lines), text[-3000:]
    assert any(line.startswith(f"accel-ctx: replica group 1 healed from replica group 0 at step "
                               f"{back - 1} in ") for line in lines), text[-3000:]
    mine, theirs = _committed(woken), _committed(healthy)
    assert all(mine[s]["sum"] == theirs[s]["sum"] for s in range(back, woken["step"] + 1))


def test_the_group_a_restarted_peer_heals_from_frozen_while_it_sends_both_go_on(
        tmp_path: Path) -> None:
    # group 1 dies after step 4 and restarts; group 0 stops (5 s, past its heartbeat) inside
    # the state it sends: the transfer waits for it, group 1 heals, and nobody else restarts
    text = _launch(tmp_path, "kill:1:4", "freeze-in-state:0:1:5")
    source, healed = _runs(tmp_path, 2)
    assert (source["restart"], healed["restart"]) == (0, 1), text[-3000:]
    _in_order(source)
    first = healed["seen"][0]["step"]
    assert first > 4, text[-3000:]  # it began where its peer was
    assert any(line.startswith(f"accel-ctx: replica group 1 healed from replica group 0 at step "
                               f"{first - 1} in ") for line in _said(text)), text[-3000:]
    mine, theirs = _committed(healed), _committed(source)
    assert all(mine[s]["sum"] == theirs[s]["sum"] for s in range(first, healed["step"] + 1))
    assert not any("left out" in line for line in _said(text)), text[-3000:]


def test_the_group_writing_checkpoints_frozen_in_a_save_leaves_none_half_written(
        tmp_path: Path) -> None:
    # resumable(every_steps=3): group 0 (the lowest, the writer) stops for 5 s inside its
    # second save (step 6); group 1 goes on alone and writes the folder meanwhile; group 0
    # wakes, finishes the old save, is told it was left out, and heals
    text = _launch(tmp_path, "save:3", "freeze-in-state:0:2:5")
    frozen, other = _runs(tmp_path, 2)
    assert (frozen["restart"], other["restart"]) == (0, 0), text[-3000:]
    _in_order(other)
    lines = _said(text)
    assert ("accel-ctx: replica group 0 left at step 6 (it stopped answering the lighthouse); "
            "1 group goes on.") in lines, text[-3000:]
    assert any(line.startswith("accel-ctx: replica group 0 healed from replica group 1")
               for line in lines), text[-3000:]
    # every checkpoint left is whole (its manifest written last), the newest at the last save
    folders = sorted((tmp_path / "ckpt").iterdir())
    assert folders and all((f / "manifest.json").is_file() for f in folders), folders
    last = max(frozen["step"], other["step"]) // 3 * 3
    assert folders[-1].name.endswith(f"-step{last}"), (folders, last)
    assert frozen["step"] == other["step"] and frozen["weights"].keys() == other["weights"].keys()
    assert all(torch.equal(frozen["weights"][k], other["weights"][k]) for k in frozen["weights"])


def test_a_group_that_wakes_after_the_others_finished_says_so_under_its_own_name(
        tmp_path: Path) -> None:
    # group 0's loop ends at step 12 while group 1 is frozen (10 s after step 8): woken, group 1
    # is the one that was left out, and nobody is left to heal from (the issue saw its line
    # under the other group's name)
    text = _launch(tmp_path, "freeze:1:8:10", "end:0:12", steps=14)
    finished, woken = _runs(tmp_path, 2)
    assert (finished["restart"], woken["restart"], finished["step"]) == (0, 0, 12), text[-3000:]
    assert _said(text) == [
        "accel-ctx: replica group 1 left at step 8 (it stopped answering the lighthouse); 1 "
        "group goes on.",
        "accel-ctx: replica group 1 was left out of the job after step 8: it did not ask the "
        "lighthouse for a quorum within its heartbeat timeout (it was stopped, paused or slowed "
        "down) and the others went on without it; no other group is left: it trains on alone "
        "from its own state."], text[-3000:]
    # alone, from its own state: its steps go on from 9, in one group
    assert [(r["step"], r["groups"]) for r in woken["seen"][8:]] == [
        (s, 1) for s in range(9, 15)], text[-3000:]
