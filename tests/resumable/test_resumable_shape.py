"""resumable() on the common shape of a training script ends bit-identical after kills.

The shape (tests/scripts/resumable_shape.py): the seed set before the scopes, `run.step` read
before the model is built (a log line) and in the loop, a model with dropout built inside,
AdamW, OneCycleLR, a shuffling DataLoader without a generator of its own. Killed (SIGKILL at a
step, mid-save, after a restart) and stopped (SIGTERM) by itself, the run ends with the weights,
optimizer and scheduler state and every step's loss of the run never interrupted; so does a
run killed on one rank before `distributed()` (the other in the rendezvous) and one killed in
the middle of a restore: the RNG
streams are the saved ones where the loop meets the save's boundary again, not where the
script first read `run.step` (the model's initialisation drew from them after that).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .. import _launcher

SCRIPT = str(_launcher.SCRIPTS / "resumable_shape.py")
STEPS = 24  # 3 epochs of 64 samples, batch 4 per rank, 2 ranks


@pytest.fixture(autouse=True)
def _stop_launchers():
    yield
    _launcher.stop_all()


def _losses(out: Path, rank: int) -> dict[int, set[str]]:
    seen: dict[int, set[str]] = {}
    for line in (out / f"loss.rank{rank}").read_text().splitlines():
        step, loss, _ = line.split()
        seen.setdefault(int(step), set()).add(loss)
    return seen


def _same(a: object, b: object, where: str) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            _same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    else:
        assert a == b, where


@pytest.mark.parametrize(("engine", "workers"), [("ddp", 0), ("sharded", 2)])
def test_the_common_script_shape_killed_and_stopped_ends_bit_identical(
        tmp_path, monkeypatch, engine, workers):
    runs = {}
    for name, kills in (("reference", ""), ("killed", "start:SIGKILL:1,7:SIGKILL,restore:SIGKILL:0,"
                                                   "13:SIGTERM,20:SIGKILL")):
        monkeypatch.setenv("KILLS", kills)
        out = tmp_path / f"{name}-out"
        out.mkdir()
        proc, log = _launcher.start(["-n", "2", "--max-restarts", "6", SCRIPT,
                                     str(tmp_path / f"{name}-ckpt"), str(out), engine,
                                     str(workers)], tmp_path, f"{name}.log")
        runs[name] = (proc, log, out)
    for proc, log, _ in runs.values():  # side by side
        assert _launcher.finish(proc, 240) == 0, log.read_text()[-6000:]
    reference, killed = runs["reference"][2], runs["killed"][2]
    text = runs["killed"][1].read_text()
    assert "SIGTERM received: saved" in text and text.count("resuming from") == 4, text[-4000:]
    for rank in range(2):
        want, got = _losses(reference, rank), _losses(killed, rank)
        assert sorted(want) == list(range(1, STEPS + 1))
        assert {s: w for s, w in want.items() if len(w) > 1} == {}
        assert got == want, (rank, {s: (got.get(s), w) for s, w in want.items() if got.get(s) != w})
        _same(torch.load(killed / f"final.rank{rank}.pt", weights_only=True),
              torch.load(reference / f"final.rank{rank}.pt", weights_only=True), f"rank{rank}")
