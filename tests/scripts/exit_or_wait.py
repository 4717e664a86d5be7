"""Run by `accel-ctx launch` in the launcher tests (no torch, so it starts at once).

usage: exit_or_wait.py exit CODE          rank 1 exits with CODE, rank 0 waits to be stopped
       exit_or_wait.py wait OUT_DIR       every rank writes OUT_DIR/pid.{rank}, then waits
A waiting rank stops quietly on Ctrl-C (as a script that handles KeyboardInterrupt does) and
gives up after 60 s (scaled as the tests' timeouts are), so a test never hangs.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from tests._timeouts import scaled

mode, arg = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
if mode == "exit" and rank == 1:
    sys.exit(int(arg))
try:
    if mode == "wait":
        tmp = Path(arg) / f".pid.{rank}"
        tmp.write_text(str(os.getpid()))
        os.replace(tmp, Path(arg) / f"pid.{rank}")
    time.sleep(scaled(60))
except KeyboardInterrupt:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher forwards a second Ctrl-C
    sys.exit(130)
sys.exit("exit_or_wait.py: nobody stopped this rank within 60 s")
