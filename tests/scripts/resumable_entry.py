"""resumable() entered before distributed(), on 2 processes: the script of
tests/resumable/test_resumable_entry.py. Writes OUT/result.rank{R}.json."""

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel_ctx import distributed, errors, resumable

folder, out = Path(sys.argv[1]), Path(sys.argv[2])
torch.manual_seed(0)
data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
result = {}


def train(run):
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.1), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(data, batch_size=4, shuffle=True)
    for _epoch in run.epochs(2):
        for x, y in loader:
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            result.setdefault("steps", []).append(run.step)


for attempt in range(2):  # the second finds the first's final checkpoint: nothing left to run
    with resumable(folder / "outer", every_steps=3) as run, distributed():
        train(run)
    result[f"finished{attempt}"] = [run.finished, run.step]
try:  # no distributed() at all: every process would think it is rank 0
    with resumable(folder / "alone") as run:
        train(run)
except errors.ConfigurationError as exc:
    result["alone"] = str(exc)
(out / f"result.rank{os.environ['RANK']}.json").write_text(
    json.dumps(result))
