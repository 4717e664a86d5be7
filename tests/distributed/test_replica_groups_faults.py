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


def test_a_frozen_group_is_dropped_rejoins_and_heals_and_one_that_finishes_says_so(
        tmp_path: Path) -> None:
    # Group 1 stops itself (SIGSTOP) for 5 s after step 4, past the lighthouse's 2 s heartbeat:
    # group 0 goes on alone; woken, group 1 kept its torchft identity and never saw itself
    # leave. It used to skip the check of script and model its peer ran at the new quorum and
    # send its gradients into it: gloo's "collective mismatch" aborted the *healthy* group,
    # which restarted. Then group 1's loop ends at step 24 (its own bound) while group 0 goes
    # on to 30: group 0 used to report it as a failure ("stopped answering the lighthouse").
    proc, log = _launcher.start(
        ["-n", "1", "--replica-groups", "2", "--max-restarts", "2", SCRIPT, str(tmp_path), "30",
         "2", "freeze:1:4:5", "end:1:24"], tmp_path, "launch.log", fork_replica_workers=True)
    code = _launcher.finish(proc, 300)
    text = log.read_text(errors="replace")
    assert code == 0, text[-3000:]
    assert "mismatch" not in text and "EnforceNotMet" not in text, text[-3000:]
    healthy, woken = _runs(tmp_path, 2)
    # neither restarted: the healthy group's one worker trained every step, in order, to 30
    assert (healthy["restart"], woken["restart"]) == (0, 0), text[-3000:]
    steps = [r["step"] for r in healthy["seen"]]
    assert steps == sorted(steps) and set(steps) == set(range(1, 31)), text[-3000:]
    # the woken group was left out after step 4 and came back at the live step, healed
    back = woken["seen"][4]["step"]
    assert [r["step"] for r in woken["seen"][:4]] == [1, 2, 3, 4] and back > 5, text[-3000:]
    lines = [line for line in text.splitlines() if line.startswith("accel-ctx: ")]
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
