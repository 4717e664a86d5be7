"""local_sgd() misused on 2 ranks, three runs in one launch; each must end with a clear error at
once, on every rank. Argument: the output folder; each rank writes rank<r>.json with, per run,
the error's type and message, the batch it came at and the seconds it took.

* "alone": local_sgd() without distributed() (nothing would average the ranks' models);
* "skipped_step": rank 1 runs batch 2's backward but not its opt.step(), so its 3rd step (the
  first synchronisation) comes one batch after rank 0's;
* "skipped_batch": rank 1 skips batch 2 altogether: the same backward passes per step, one step
  fewer at the end (rank 0 takes 7 steps, rank 1 6).
"""

import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from accel_ctx import distributed, local_sgd

out = sys.argv[1]
rank = int(os.environ["RANK"])
torch.manual_seed(rank)  # each rank its own batches
batches = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(7)]
results: dict[str, dict[str, object]] = {}


def train(name: str, skip: str | None) -> None:
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    began, at = time.monotonic(), -1
    try:
        with local_sgd(every=3):
            for at, (x, y) in enumerate(batches, 1):
                if skip == "batch" and rank == 1 and at == 2:
                    continue
                F.mse_loss(model(x), y).backward()
                if not (skip == "step" and rank == 1 and at == 2):
                    opt.step()
                opt.zero_grad()
            at = 0  # the loop ended: what follows comes at the scope's exit
    except Exception as exc:
        results[name] = {"type": type(exc).__name__, "message": str(exc), "at": at,
                         "seconds": time.monotonic() - began}
    else:
        results[name] = {"type": None, "message": "", "at": at, "seconds": 0.0}


train("alone", None)
for name, skip in (("skipped_step", "step"), ("skipped_batch", "batch")):
    try:
        with distributed():
            train(name, skip)
    except Exception as exc:  # recorded for the test
        results[name + "_scope"] = {"type": type(exc).__name__, "message": str(exc)}
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(results, f)
