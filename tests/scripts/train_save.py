"""Run by `accel-ctx launch` in the tests: train the shared MLP in distributed(), save params.

usage: train_save.py OUT_DIR PER_RANK_BATCH
Each rank writes OUT_DIR/rank{R}.pt with its parameters and what state() said.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from accel_ctx import distributed, state
from tests.workers.common import params, train

out, batch = Path(sys.argv[1]), int(sys.argv[2])
with distributed():
    s = state()
    model = train("mlp", batch)
    info = {
        "params": params(model),
        "rank": s.rank,
        "world_size": s.world_size,
        "local_rank": s.local_rank,
        "local_world_size": s.local_world_size,
        "mixed_precision": s.mixed_precision,
        "master_addr": os.environ.get("MASTER_ADDR"),
        "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
    }
tmp = out / f".rank{s.rank}.tmp"
torch.save(info, tmp)
os.replace(tmp, out / f"rank{s.rank}.pt")
