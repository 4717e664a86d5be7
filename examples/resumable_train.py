"""Never lose a run: ``resumable()`` saves every few steps and a restart carries on by itself.

The loop is the plain one: no ``save_state``, no ``load_state``, no "which epoch was I at".
Stop it and start the same command again: it carries on from its last checkpoint. A SIGTERM
or SIGUSR1 (a preempted node, a SLURM time limit; ``--stop-at-step`` sends one to itself) saves
at the next step boundary and exits with 128 + the signal's number, so nothing is lost; a hard
kill (``--crash-at-step``: ``os._exit``, as an OOM or a lost machine) resumes from the last
save that had finished (saves run every ``--every-steps`` steps, in the background; a kill
while one is being written loses it too). ``--crash-at-step`` kills a run that started fresh
only: the restarted one carries on.

    python examples/resumable_train.py --out run --stop-at-step 5    # saves step 5, exits 143
    python examples/resumable_train.py --out run                     # resumes at step 5, ends
    accel-ctx launch -n 2 --max-restarts 3 examples/resumable_train.py --out run2 --crash-at-step 7
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel_ctx import distributed, main_print, resumable, state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/resumable", help="the run's checkpoint folder")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--every-steps", type=int, default=3, help="save every N optimizer steps")
    parser.add_argument("--stop-at-step", type=int, default=None,
                        help="send this process a SIGTERM at this optimizer step, as a preemption")
    parser.add_argument("--crash-at-step", type=int, default=None,
                        help="die (os._exit) at this optimizer step, as a crash would, in a run "
                             "that started fresh (the restarted run carries on)")
    args = parser.parse_args()

    torch.manual_seed(0)  # set before the scopes, as scripts do; a resume restores the streams
    x = torch.randn(256, 16)
    y = (x[:, :4].sum(1) > 0).long()
    with distributed(), resumable(args.out, every_steps=args.every_steps) as run:
        if run.resumed:
            main_print(f"resumed from {args.out} at step {run.step}")
        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
        loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
        # Met by the loop, each object is restored when it is first used; tracked, at once:
        # a finished run started again takes no step and still reads the trained ones below.
        run.track(net=model, opt=opt, sched=sched)
        for epoch in run.epochs(args.epochs):  # after a restart: from the saved epoch on
            for xb, yb in loader:              # ... and from the first batch not trained on
                loss = F.cross_entropy(model(xb), yb)
                loss.backward()
                opt.step()
                sched.step()
                opt.zero_grad()
                if run.step == args.stop_at_step:
                    os.kill(os.getpid(), signal.SIGTERM)  # saved at the next boundary, then exit
                if run.step == args.crash_at_step and not run.resumed:
                    print(f"rank {state().rank}: crashing at step {run.step}", flush=True)
                    os._exit(1)  # no cleanup, no final save: what a killed process leaves
            main_print(f"epoch {epoch}: loss {loss.item():.4f}")
        checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
        # inside the scopes: outside distributed() every process is its own main process
        main_print(f"done: step {run.step}, weights checksum {checksum:.10f}")


if __name__ == "__main__":
    main()
