"""Run by `accel-ctx launch` in tests/group/test_waits_default.py (issue #52, point 3): the waits
that ended late or blamed the wrong rank, each with distributed()'s default timeout (600 s).
The rank at fault prints "FAULT <time.time()>" where the fault happens.

usage: waits_default.py MODE

  alive_after_failure  sharded(): rank 1 raises at step 3; the script catches it outside the
                       scope and goes on with something else (its process stays alive)
  caught_in_scope      sharded(): rank 1's forward raises at step 3; the loop catches it and
                       goes on with work of its own inside the scope
  skip_backward        distributed(): rank 1 skips loss.backward() at step 2 but steps
  first_call_on_rank0  distributed(): a module first called in training at step 2, on rank 0 only
  reduce_vs_gather     reduce() on rank 0, gather() on the others, at step 2
  sharded_rank0        a sharded forward under `if rank == 0:`, the others at wait_for_everyone()
  out_of_memory        find_executable_batch_size, rank 1 out of memory before its forward
"""

from __future__ import annotations

import sys
import time

import torch
from torch import nn

from accel_ctx import (
    distributed,
    find_executable_batch_size,
    gather,
    reduce,
    sharded,
    state,
    wait_for_everyone,
)

mode = sys.argv[1]


def fault() -> None:
    print(f"FAULT {time.time():.3f}", flush=True)


def batch() -> torch.Tensor:
    return torch.randn(4, 8) + state().rank  # each rank its own data


class Picky(nn.Module):
    """A layer whose forward raises on rank 1 at step 3 (a bad sample, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if state().rank == 1 and state().step == 3:
            fault()
            raise ValueError("bad batch")
        return self.lin(x)


torch.manual_seed(0)
if mode == "alive_after_failure":
    try:
        with distributed(), sharded():
            model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(6):
                if state().rank == 1 and step == 3:
                    fault()
                    raise ValueError("bad batch")
                model(batch()).sum().backward()
                opt.step()
                opt.zero_grad()
    except ValueError:
        time.sleep(300)  # something else: the process lives on
elif mode == "caught_in_scope":
    with distributed(), sharded():
        model = nn.Sequential(nn.Linear(8, 8), Picky(), nn.Linear(8, 8))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(6):
            try:
                loss = model(batch()).sum()
            except ValueError:
                time.sleep(300)  # work of its own (a long evaluation of what failed, say)
                continue
            loss.backward()
            opt.step()
            opt.zero_grad()
elif mode == "skip_backward":
    with distributed():
        model = nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(8):
            loss = model(batch()).pow(2).mean()
            if state().rank == 1 and step == 2:
                fault()
            else:
                loss.backward()
            opt.step()
            opt.zero_grad()
        print("END", gather(torch.tensor([1.0])).tolist(), flush=True)
elif mode == "first_call_on_rank0":
    with distributed():
        model, head = nn.Linear(8, 1), nn.Linear(8, 1)
        opt = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.1)
        for step in range(6):
            loss = model(batch()).pow(2).mean()
            if state().rank == 0 and step == 2:
                fault()
                loss = loss + head(batch()).pow(2).mean()  # first called here, on rank 0 only
            loss.backward()
            opt.step()
            opt.zero_grad()
elif mode == "reduce_vs_gather":
    with distributed():
        model = nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(5):
            loss = model(batch()).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step == 2:
                if state().rank == 0:
                    fault()
                (reduce if state().rank == 0 else gather)(loss.detach())
elif mode == "sharded_rank0":
    with distributed(), sharded():
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(batch()).sum().backward()
            opt.step()
            opt.zero_grad()
        if state().rank == 0:
            fault()
            with torch.no_grad():
                model(batch())
        wait_for_everyone()
elif mode == "out_of_memory":
    with distributed():
        @find_executable_batch_size(starting_batch_size=8)
        def train(batch_size: int) -> int:
            model = nn.Linear(4, 4)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            if state().rank == 1 and batch_size > 4:  # before it reaches the forward
                fault()
                raise torch.OutOfMemoryError("CUDA out of memory (pretend)")
            for _ in range(2):
                model(torch.randn(batch_size, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
            return batch_size

        train()
else:
    raise SystemExit(f"unknown mode {mode!r}")
