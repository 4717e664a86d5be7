"""Run by `accel-ctx launch --max-restarts 1` in the checkpoint tests: train, save, crash once.

usage: checkpoint_train.py CKPT_DIR OUT_DIR [CRASH_AFTER]
Trains tests.workers.checkpoint's fp16 + accumulate(2) loop, resuming from CKPT_DIR and saving
there every 4 micro-batches. On the first attempt (TORCHELASTIC_RESTART_COUNT=0) rank 1
SIGKILLs itself after CRASH_AFTER micro-batches; torchrun restarts both ranks, which resume
from the newest checkpoint. Each rank writes OUT_DIR/attempt{A}.rank{R} (the step it resumed
from) and, at the end, OUT_DIR/final.rank{R}.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.workers.checkpoint import train_script

crash_after = int(sys.argv[3]) if len(sys.argv) > 3 else None
train_script(Path(sys.argv[1]), Path(sys.argv[2]), save_every=4, crash_after=crash_after)
