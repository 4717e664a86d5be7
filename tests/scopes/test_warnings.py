"""accel_ctx's warnings name the user's line, however deep in the package they are raised."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from accel_ctx import load_state, save_state


def test_a_skipped_checkpoint_warning_points_at_the_load_state_call(tmp_path):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    save_state(tmp_path, model=model, optimizer=opt)
    newer = save_state(tmp_path, model=model, optimizer=opt)
    (newer / "manifest.json").unlink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_state(tmp_path, model=model, optimizer=opt)  # the line the warning must name
    assert caught, "no warning for the incomplete checkpoint"
    assert {w.filename for w in caught} == {__file__}, [(w.filename, w.lineno) for w in caught]
