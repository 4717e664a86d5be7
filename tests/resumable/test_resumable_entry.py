"""How resumable() is entered (issue 38, 7b): as a decorator, before distributed(), from a copy
of the script, and a resumed loop that counts its epochs with range()."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from .. import _launcher, _zygote

SCRIPT = str(_launcher.SCRIPTS / "resumable_entry.py")


@pytest.fixture(autouse=True)
def _stop_launchers():
    yield
    _launcher.stop_all()


def test_resumable_entered_before_distributed_on_2_processes(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    proc, log = _launcher.start(["-n", "2", SCRIPT, str(tmp_path / "runs"), str(out)],
                                tmp_path, "launch.log")
    code = _launcher.finish(proc, 120)
    text = log.read_text()
    assert code == 0, text[-4000:]
    results = [json.loads((out / f"result.rank{r}.json").read_text()) for r in range(2)]
    for result in results:
        assert result["steps"] == list(range(1, 9))  # 2 epochs of 4 batches per rank, once
        assert result["finished1"] == [True, 8]  # the final checkpoint was written: no step
        assert "distributed()" in result["alone"]
    assert "another run is using this folder" not in text


SCRIPT_SHAPE = """
import os, signal, sys, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from accel_ctx import resumable

folder, stop_at, form = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
data = TensorDataset(torch.randn(24, 4), torch.randn(24, 1))
run = resumable(folder, every_steps=2)
losses = []

@run
def train():
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(data, batch_size=4, shuffle=True)
    epochs = run.epochs(2) if form == "epochs" else range(2)
    for epoch in epochs:
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward(); opt.step(); opt.zero_grad()
            losses.append(f"{loss.item():.8f}")
            if run.step == stop_at:
                os.kill(os.getpid(), signal.SIGTERM)
    return model

model = train()
print("LOSSES", " ".join(losses))
print("WEIGHTS", " ".join(f"{p.sum().item():.8f}" for p in model.parameters()))
print("STEP", run.step)
"""


def _python(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return _zygote.run_script(str(script), *args, cwd=script.parent, timeout=300)


def _field(text: str, name: str) -> list[str]:
    return next(line.split()[1:] for line in text.splitlines() if line.startswith(name))


def test_a_decorated_training_function_resumes_like_the_with_form(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT_SHAPE)
    whole = _python(script, str(tmp_path / "whole"), "0", "epochs")
    assert whole.returncode == 0, whole.stderr[-3000:]
    first = _python(script, str(tmp_path / "run"), "4", "epochs")
    assert first.returncode == 128 + 15, first.stderr[-3000:]
    second = _python(script, str(tmp_path / "run"), "0", "epochs")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming from" in second.stderr
    assert _field(second.stdout, "LOSSES") == _field(whole.stdout, "LOSSES")[4:]
    assert _field(second.stdout, "WEIGHTS") == _field(whole.stdout, "WEIGHTS")
    assert _field(second.stdout, "STEP") == ["12"]


def test_a_copy_of_the_script_elsewhere_is_refused_a_moved_one_warned(tmp_path):
    script, folder = tmp_path / "train.py", str(tmp_path / "run")
    script.write_text(SCRIPT_SHAPE)
    assert _python(script, folder, "4", "epochs").returncode == 128 + 15
    other = tmp_path / "exp2" / "train.py"  # a new experiment: another learning rate
    other.parent.mkdir()
    other.write_text(SCRIPT_SHAPE.replace("lr=0.1", "lr=0.2"))
    refused = _python(other, folder, "0", "epochs")
    assert refused.returncode != 0
    assert "CheckpointError" in refused.stderr and str(script) in refused.stderr
    assert str(other) in refused.stderr
    moved = tmp_path / "moved" / "train.py"
    moved.parent.mkdir()
    moved.write_text(SCRIPT_SHAPE)
    resumed = _python(moved, folder, "6", "epochs")
    assert resumed.returncode == 128 + 15, resumed.stderr[-3000:]
    assert "same script at" in resumed.stderr and "resuming from" in resumed.stderr
    moved.write_text(SCRIPT_SHAPE.replace("lr=0.1", "lr=0.1 ") + "\n# a fix\n")  # edited
    again = _python(moved, folder, "0", "epochs")
    assert again.returncode == 0 and "resuming from" in again.stderr, again.stderr[-3000:]


def test_a_resumed_loop_counting_epochs_with_range_is_warned(tmp_path):
    script, folder = tmp_path / "train.py", str(tmp_path / "run")
    script.write_text(SCRIPT_SHAPE)
    assert _python(script, folder, "8", "range").returncode == 128 + 15
    resumed = _python(script, folder, "0", "range")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stderr.count("run.epochs(n)") == 1
    # a loop bound by state().step is not warned about
    script.write_text(SCRIPT_SHAPE.replace("from accel_ctx import resumable",
                                           "from accel_ctx import resumable, state").replace(
        "    for epoch in epochs:\n", "    while state().step < 12:\n"))
    folder = str(tmp_path / "run-steps")
    assert _python(script, folder, "8", "range").returncode == 128 + 15
    resumed = _python(script, folder, "0", "range")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "run.epochs(n)" not in resumed.stderr and "STEP 12" in resumed.stdout
