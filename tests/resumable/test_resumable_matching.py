"""resumable() finds each object's saved state by what it is, not by the order it is met.

A resumed run meets its objects in another order than the run it resumes (a frozen teacher
called every 10th step comes after the student once resumed at step 15; a validation loader
iterated before training at step 0 is not iterated at all): each must still get its own state.
A change between restarts that the saved state cannot follow (the batch size) is refused, and
one it overrides (the learning rate) is said. One process, in this process: the scope works
without a launcher.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel_ctx import distributed, errors, resumable

_g = torch.Generator().manual_seed(1)
DATA = TensorDataset(torch.randn(96, 4, generator=_g), torch.arange(96))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1, self.drop, self.lin2 = nn.Linear(4, 16), nn.Dropout(0.2), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.drop(torch.tanh(self.lin1(x))))


def _train(folder: Path, epochs: int = 2, stop_at: int | None = None, batch: int = 8,
           lr: float = 0.05, teacher: bool = False, val: bool = False
           ) -> tuple[list[int], dict[str, Any]]:
    """The script: (the samples trained on, in order; the final state, {} when stopped)."""
    seen: list[int] = []
    try:
        with distributed(), resumable(folder, every_steps=5) as run:
            torch.manual_seed(0)
            frozen = Net().requires_grad_(False).eval()  # same class as the student
            model = Net()
            opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
            loader = DataLoader(DATA, batch_size=batch, shuffle=True)
            checks = DataLoader(DATA, batch_size=batch)  # evaluation: the same data, in order
            for _epoch in run.epochs(epochs):
                if val and run.step == 0:  # the untrained model's loss, once, before training
                    with torch.no_grad():
                        sum(model(x).pow(2).mean().item() for x, _ in checks)
                for x, index in loader:
                    if run.step == stop_at:
                        raise KeyboardInterrupt
                    if teacher and run.step % 10 == 0:  # the teacher first, every 10th step
                        with torch.no_grad():
                            soft = frozen(x)
                        loss = (model(x) - soft).pow(2).mean()
                    else:
                        loss = model(x).pow(2).mean()
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    seen += index.tolist()
    except KeyboardInterrupt:
        return seen, {}
    return seen, {"student": model.state_dict(), "teacher": frozen.state_dict(),
                  "momentum": [s["momentum_buffer"] for s in opt.state_dict()["state"].values()]}


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    for name in ("student", "teacher"):
        for key, value in want[name].items():
            assert torch.equal(got[name][key], value), f"{name}.{key}"
    assert all(torch.equal(a, b) for a, b in zip(got["momentum"], want["momentum"], strict=True))


def test_a_teacher_met_after_the_student_once_resumed_keeps_its_own_weights(tmp_path):
    full, want = _train(tmp_path / "a", epochs=3, teacher=True)
    first, _ = _train(tmp_path / "b", epochs=3, teacher=True, stop_at=17)  # saved at 15
    # resumed at 15: the student is met first, the teacher at 20; saved at 25 with both
    second, _ = _train(tmp_path / "b", epochs=3, teacher=True, stop_at=27)
    rest, got = _train(tmp_path / "b", epochs=3, teacher=True)  # from 25: the student first
    assert first[:15 * 8] + second[:10 * 8] + rest == full
    _same(got, want)


def test_a_validation_loader_iterated_first_at_step_0_keeps_its_position(tmp_path):
    full, want = _train(tmp_path / "a", val=True)
    first, _ = _train(tmp_path / "b", val=True, stop_at=17)  # saved at 15: val's, then train's
    rest, got = _train(tmp_path / "b", val=True)  # the training loader is iterated first
    assert first[:15 * 8] + rest == full
    _same(got, want)


def test_a_batch_size_changed_between_restarts_is_refused(tmp_path):
    _train(tmp_path, stop_at=7)  # saved at 5: 40 of 96 samples of the epoch trained
    with pytest.raises(errors.CheckpointError,
                       match=r"batch_size=8.*this loader has batch_size=6.*new folder"):
        _train(tmp_path, batch=6)


def test_an_lr_changed_between_restarts_is_said_and_the_run_resumes_as_it_was(tmp_path):
    _, want = _train(tmp_path / "a")
    _train(tmp_path / "b", stop_at=7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, got = _train(tmp_path / "b", lr=0.2)
    said = [str(w.message) for w in caught if "lr=" in str(w.message)]
    assert len(said) == 1 and "built with lr=0.2 in this script" in said[0]
    assert "was built with lr=0.05" in said[0] and "checkpoint's state is used" in said[0]
    _same(got, want)  # the checkpoint's lr trained on


def test_a_checkpoint_saved_without_descriptions_still_resumes_by_order(tmp_path, monkeypatch):
    from accel_ctx._checkpoint import match
    from accel_ctx._checkpoint.resume_run import ResumeRuntime

    full, want = _train(tmp_path / "a")
    real = ResumeRuntime.objects
    monkeypatch.setattr(ResumeRuntime, "objects", lambda self: {  # as saved before they were
        name: obj for name, obj in real(self).items() if name != match.ENTRY})
    first, _ = _train(tmp_path / "b", stop_at=7)
    monkeypatch.undo()
    rest, got = _train(tmp_path / "b")
    assert first[:5 * 8] + rest == full
    _same(got, want)
