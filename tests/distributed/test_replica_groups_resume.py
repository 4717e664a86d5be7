"""resumable() in replica groups: one healthy group writes the job's folder, a job that lost
every group resumes from it, and per-group folders are refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from .. import _launcher

pytest.importorskip("torchft", reason="replica groups need torchft (pip install 'accel-ctx[ft]')")

pytestmark = pytest.mark.usefixtures("_stop_launchers")


def _start(tmp_path: Path, name: str, kill_at: int, place: str, restarts: int = 1,
           only: tuple[str, ...] = ()) -> tuple[Any, Path, Path]:
    out = tmp_path / name
    out.mkdir()
    script = str(_launcher.SCRIPTS / "replica_groups_resume.py")
    proc, log = _launcher.start(
        ["-n", "1", "--replica-groups", "2", "--max-restarts", str(restarts), script, str(out), "10",
         str(kill_at), place, *only], tmp_path, f"{name}.log", fork_replica_workers=True)
    return proc, log, out


def _finish(started: tuple[Any, Path, Path]) -> tuple[int, str, Path]:
    proc, log, out = started
    code = _launcher.finish(proc, 300)
    return code, log.read_text(errors="replace"), out


def _launch(tmp_path: Path, name: str, kill_at: int, place: str, restarts: int = 1,
            only: tuple[str, ...] = ()) -> tuple[int, str, Path]:
    return _finish(_start(tmp_path, name, kill_at, place, restarts, only))


def test_a_job_that_lost_every_group_resumes_from_the_folder_one_group_wrote(
        tmp_path: Path) -> None:
    killed = _start(tmp_path, "killed", 5, "shared")  # side by side with the reference
    code_whole, text_whole, whole = _finish(_start(tmp_path, "whole", -1, "shared"))
    code, text, out = _finish(killed)
    assert code == 0, text[-3000:]
    assert code_whole == 0, text_whole[-3000:]
    runs = [torch.load(out / f"group{g}.pt") for g in range(2)]
    assert [r["restart"] for r in runs] == [1, 1] and [r["step"] for r in runs] == [10, 10]
    assert "resuming from ckpt-000001-step3 (step 3" in text, text[-3000:]
    reference = torch.load(whole / "group0.pt")["weights"]
    for run in runs:  # the restarted job equals the one never stopped
        for key, value in reference.items():
            torch.testing.assert_close(run["weights"][key], value, rtol=0, atol=1e-6)
    assert not (out / "ckpt-group1").exists()


def test_per_group_resumable_folders_are_refused_and_the_other_group_trains_on(
        tmp_path: Path) -> None:
    code, text, out = _launch(tmp_path, "per-group", -1, "per-group", restarts=0)
    assert code != 0  # group 1 stopped with the cause
    assert "keeps its resumable() checkpoints in another folder than replica group 0" in text, (
        text[-3000:])
    assert torch.load(out / "group0.pt")["step"] == 10  # nothing lost: group 0 finished
    assert "replica group 1 left at step 0 (replica group 1 keeps its resumable()" in text


def test_a_group_that_restarts_beside_a_live_one_heals_from_it_not_from_the_older_folder(
        tmp_path: Path) -> None:
    code, text, out = _launch(tmp_path, "one", 5, "shared", only=("1",))
    assert code == 0, text[-3000:]
    runs = [torch.load(out / f"group{g}.pt") for g in range(2)]
    assert [r["restart"] for r in runs] == [0, 1] and runs[0]["step"] == runs[1]["step"] >= 10
    assert "resuming from" in text and "replica group 1 healed from replica group 0" in text
    for key, value in runs[0]["weights"].items():  # the peer's state won over step 3's
        assert torch.equal(runs[1]["weights"][key], value), key
