"""resumable() off its main path, in the forms users write (issue 52): loops whose batches come
from no DataLoader (the decorator on a fixed-count loop, the docs' decorated ``run.epochs()``
loop over a tensor of batches, the same loop in the ``with`` form), epochs counted with
``range(n)`` after a ``state()`` read, and a validation loader met only at the start."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from .. import _launcher, _zygote

SCRIPT = str(_launcher.SCRIPTS / "resumable_forms.py")


def _python(*args: str) -> subprocess.CompletedProcess[str]:
    return _zygote.run_script(SCRIPT, *args, timeout=300)


def _field(text: str, name: str) -> list[str]:
    return next(line.split()[1:] for line in text.splitlines() if line.startswith(name))


def _newest(folder: Path) -> list[str]:
    newest = sorted(folder.glob("ckpt-*"))[-1]
    return json.loads((newest / "manifest.json").read_text())["objects"]


def test_loops_over_a_tensor_of_batches_resume_exactly_or_are_refused_at_once(tmp_path):
    whole = _python(str(tmp_path / "whole"), "with", "0")
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert _field(whole.stdout, "STEP") == ["16"]
    # The docs' decorated form, stopped in its second epoch: the epoch's steps since its start
    # cannot be skipped by a loop over a tensor, so the restart trains that epoch again from
    # the checkpoint at its start (the periodic saves inside it waited for its end): exact.
    folder = str(tmp_path / "docs")
    stopped = _python(folder, "docs", "11")
    assert stopped.returncode == 128 + 15, stopped.stderr[-3000:]
    assert "step 11 was not saved" in stopped.stderr and "ckpt-" in stopped.stderr
    resumed = _python(folder, "docs", "0")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr and "(step 8, epoch 1)" in resumed.stderr
    assert _field(resumed.stdout, "STEP") == ["16"]
    assert _field(resumed.stdout, "WEIGHTS") == _field(whole.stdout, "WEIGHTS")
    # @resumable(d) on a fixed-count loop: its final checkpoint, written after the function
    # returned, holds the model and the optimizer; started again, the loop (which knows
    # neither its step nor its epoch) is refused before it trains its steps again.
    folder = str(tmp_path / "fixed")
    first = _python(folder, "fixed", "0")
    assert first.returncode == 0, first.stderr[-3000:]
    assert {"model0", "optimizer0"} <= set(_newest(Path(folder)))
    again = _python(folder, "fixed", "0")
    assert again.returncode != 0 and "ConfigurationError" in again.stderr, again.stderr[-3000:]
    assert "state().step" in again.stderr and "run.epochs(n)" in again.stderr


def test_a_resumed_loop_counting_epochs_with_range_after_a_state_read_is_warned(tmp_path):
    folder = str(tmp_path / "range")
    assert _python(folder, "range", "10").returncode == 128 + 15  # epoch 1, its 3rd batch
    resumed = _python(folder, "range", "0")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stderr.count("run.epochs(n)") == 1, resumed.stderr[-3000:]


@pytest.mark.parametrize("form", ["val", "val-same"])
def test_a_validation_loader_met_only_at_the_start_keeps_its_own_position(tmp_path, form):
    # "val": the validation loader is unlike the training one (its samples, its sampler);
    # "val-same": like it in all it describes (same length, batch size, shuffled).
    whole = _python(str(tmp_path / "whole"), form, "0")
    assert whole.returncode == 0 and _field(whole.stdout, "STEP") == ["20"], whole.stderr[-3000:]
    folder = str(tmp_path / "run")
    for _ in range(2 if form == "val" else 1):  # stopped at step 7 (and again at 14)
        assert _python(folder, form, "7").returncode == 128 + 15
    resumed = _python(folder, form, "0")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert ", epoch 1)" in resumed.stderr if form == "val" else ", epoch 0)" in resumed.stderr
    assert _field(resumed.stdout, "STEP") == ["20"]
    assert _field(resumed.stdout, "WEIGHTS") == _field(whole.stdout, "WEIGHTS")


def test_a_save_state_folder_given_to_resumable_says_what_it_is_and_what_to_do(tmp_path):
    folder = str(tmp_path / "saved")
    assert _python(folder, "save_state", "0").returncode == 0
    refused = _python(folder, "with", "0")
    assert refused.returncode != 0 and "CheckpointError" in refused.stderr, refused.stderr[-3000:]
    assert "written by save_state()" in refused.stderr and "load_state(" in refused.stderr
    assert "resuming from" not in refused.stderr and "STEP" not in refused.stdout


def test_an_object_met_after_its_checkpoint_was_rotated_out_is_restored(tmp_path):
    # Resumed at step 4, the run saves at 6, 8 and 10 (keep_last=2): the checkpoint it resumed
    # from is gone when the second model is met again at step 11; a newer one carries it.
    whole = _python(str(tmp_path / "whole"), "late", "0")
    assert whole.returncode == 0, whole.stderr[-3000:]
    folder = str(tmp_path / "run")
    assert _python(folder, "late", "3").returncode == 128 + 15
    resumed = _python(folder, "late", "0")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not (tmp_path / "run" / "ckpt-000002-step4").exists()
    assert _field(resumed.stdout, "STEP") == ["12"]
    assert _field(resumed.stdout, "WEIGHTS") == _field(whole.stdout, "WEIGHTS")


def test_a_resumed_run_warns_once_of_a_model_copy_it_does_not_know(tmp_path):
    folder = str(tmp_path / "ema")
    assert _python(folder, "ema", "3").returncode == 128 + 15
    resumed = _python(folder, "ema", "0")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stderr.count("copy.deepcopy(model)") == 1, resumed.stderr[-3000:]
    assert "run.track(ema=" in resumed.stderr
    # tracked, the copy is saved and restored: no warning, the EMA of the run never stopped
    whole = _python(str(tmp_path / "whole"), "ema-tracked", "0")
    folder = str(tmp_path / "tracked")
    assert _python(folder, "ema-tracked", "3").returncode == 128 + 15
    resumed = _python(folder, "ema-tracked", "0")
    assert resumed.returncode == 0 and "copy.deepcopy" not in resumed.stderr, resumed.stderr
    assert _field(resumed.stdout, "WEIGHTS") == _field(whole.stdout, "WEIGHTS")
