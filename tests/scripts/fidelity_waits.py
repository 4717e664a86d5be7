"""Run by `accel-ctx launch` in tests/group/test_fidelity_waits.py (issue #23, point 9).

usage: fidelity_waits.py rank_only     rank 0 works alone for 60 s (rank-only code); rank 1
                                       waits for it in wait_for_everyone() and times out first
       fidelity_waits.py exit_early    rank 1 ends its process with os._exit(0) at step 5, its
                                       heartbeat starved (it published once, at the start)
"""

from __future__ import annotations

import os
import sys
import time

import torch

from accel_ctx import distributed, state, wait_for_everyone
from accel_ctx._job import progress as _progress

mode = sys.argv[1]
if mode == "rank_only":
    with distributed(timeout=5):
        if state().rank == 0:
            time.sleep(60)  # the launcher stops it once rank 1 has failed
        wait_for_everyone()
elif mode == "exit_early":
    if os.environ["RANK"] == "1":
        _progress.INTERVAL_S = 3600.0  # as on a busy machine: the heartbeat never runs again
    with distributed(timeout=60):
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(20):
            if state().rank == 1 and state().step == 5:
                os._exit(0)
            model(torch.randn(8, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
