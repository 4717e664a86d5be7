"""A user's correct script under every scope prints no warning (issue 41): the scopes' patches
and the engines they call (DDP, FSDP2, autocast, GradScaler, DCP, DataLoader workers) add
none to what the same loop prints without accel_ctx."""

from __future__ import annotations

from .._spawn import spawn
from ..workers import quiet


def test_correct_scripts_under_every_scope_print_no_warning_on_two_ranks(tmp_path):
    ran = spawn(quiet.every_scope, 2, tmp_path, str(tmp_path))
    loops = ["distributed", "bf16", "fp16", "accumulate", "local_sgd", "sharded", "save_state",
             "load_state", "sharded_state", "resumable"]
    assert ran == [loops, loops]
