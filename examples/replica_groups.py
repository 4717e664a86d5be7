"""Fault-tolerant replica groups: the plain loop, started as R groups that go on when one fails.

The launcher starts a torchft lighthouse and R groups of -n processes each. Inside a group the
model trains under DDP as it would under ``distributed()`` alone; across the groups the
gradients are averaged at every step over the groups alive. A group that fails is restarted by
its own launcher (``--max-restarts``) and heals from a live group (weights, optimizer,
scheduler, loader position, random streams), while the others go on without waiting. The loop
is bounded by ``state().step``, the job's committed steps: a group that healed continues from
its peers' step, not from 0. Each group's rank 0 prints one line; the checksums are equal.
Needs torchft (``pip install 'torchft>=0.2'``, or ``pip install -e '.[ft]'`` in the clone).

    accel-ctx launch -n 1 --replica-groups 2 examples/replica_groups.py
    accel-ctx launch -n 1 --replica-groups 2 --max-restarts 1 examples/replica_groups.py \\
        --fail-group 1 --fail-at-step 4        # group 1 dies at step 4, restarts and heals
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel_ctx import distributed, main_print, state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--fail-group", type=int, default=-1, help="the group that fails once")
    parser.add_argument("--fail-at-step", type=int, default=-1)
    args = parser.parse_args()
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0

    torch.manual_seed(0)
    x = torch.randn(256, 8)
    y = x[:, :2].sum(1, keepdim=True)
    with distributed():
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
        loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
        most, deadline, done = 0, time.monotonic() + 120, False
        while not done:
            for xb, yb in loader:
                loss = F.mse_loss(model(xb), yb)
                loss.backward()
                opt.step()
                sched.step()
                opt.zero_grad()
                s = state()  # s.step: the job's committed steps, the same in every group
                if (s.replica_group, s.step, restarted) == (args.fail_group, args.fail_at_step,
                                                           False):
                    os.kill(os.getpid(), signal.SIGKILL)  # a crash: the group restarts, heals
                most = max(most, s.replica_groups)
                if s.replica_groups < most:  # a group is away: a toy model's steps are quick,
                    time.sleep(0.2)          # so go slowly enough for it to come back
                done = s.step >= args.steps and (s.replica_groups == most
                                                 or time.monotonic() > deadline)
                if done:
                    break
        s = state()
        checksum = sum(p.double().sum().item() for p in model.parameters())
        main_print(f"group {s.replica_group}: done at step {s.step} with {s.replica_groups} "
                   f"group(s), loss {loss.item():.4f}, weights checksum {checksum:.6f}")


if __name__ == "__main__":
    main()
