"""A user's correct script under every scope prints no warning (issue 41): the scopes' patches
and the engines they call (DDP, FSDP2, autocast, GradScaler, DCP, DataLoader workers) add
none to what the same loop prints without accel_ctx."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .._spawn import spawn
from .._timeouts import scaled
from ..workers import quiet

ROOT = Path(__file__).resolve().parents[2]


def test_correct_scripts_under_every_scope_print_no_warning_on_two_ranks(tmp_path):
    ran = spawn(quiet.every_scope, 2, tmp_path, str(tmp_path))
    loops = ["distributed", "bf16", "fp16", "accumulate", "local_sgd", "sharded", "save_state",
             "load_state", "sharded_state", "resumable"]
    assert ran == [loops, loops]


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is not installed (pip install transformers)")
def test_the_hugging_face_example_starts_without_torchaos_import_lines(tmp_path):
    # issue 52: transformers imports torchao, which logged a "Failed to load" line per CUDA
    # kernel library (and torch a notice per Enum it registers) before the example's first line
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "hf_finetune.py"), "--steps",
                          "1"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=scaled(180), env={**os.environ, "ACCEL_CTX_DEVICE": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Failed to load" not in out.stderr and "is an Enum subclass" not in out.stderr, (
        out.stderr[-3000:])
