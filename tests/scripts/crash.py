"""Run by `accel-ctx launch` in the fault tests: all-reduce in a loop until a rank is killed.

usage: crash.py OUT_DIR
Every attempt (TORCHELASTIC_RESTART_COUNT) writes OUT_DIR/pid.{attempt}.{rank}. The first
attempt steps until the test kills a rank (or 60 s pass, scaled as the tests' timeouts are: then
it fails, so a test never hangs);
a restarted attempt takes a few steps, writes OUT_DIR/done.{rank} and exits cleanly.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from accel_ctx import distributed, state
from tests._timeouts import scaled

out = Path(sys.argv[1])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def publish(name: str, text: str) -> None:
    tmp = out / f".{name}.tmp"
    tmp.write_text(text)
    os.replace(tmp, out / name)  # the test never reads half a file


with distributed(timeout=scaled(60)):
    rank, precision = state().rank, state().mixed_precision
    publish(f"pid.{attempt}.{rank}", str(os.getpid()))
    deadline = time.monotonic() + scaled(60)
    steps = 0
    while (steps < 5) if attempt > 0 else (time.monotonic() < deadline):
        value = torch.ones(())
        dist.all_reduce(value)
        steps += 1
        time.sleep(0.05)
    if attempt == 0:
        sys.exit("crash.py: nobody was killed within 60 s")
publish(f"done.{rank}", json.dumps({"steps": steps, "precision": precision}))
