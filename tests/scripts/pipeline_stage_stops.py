"""pp=2: the last stage stops (SIGSTOP) in its forward at step 3, while the first
stage waits for its output: the first stage must end within distributed(timeout=...), naming rank 1."""

import os
import signal

import torch
import torch.nn.functional as F

from accel_ctx import distributed, state
from tests._timeouts import scaled  # a busy machine: the tests' factor
from tests.workers.pipeline import LENGTH, LM, VOCAB

if __name__ == "__main__":
    torch.manual_seed(0)
    with distributed(pp=2, timeout=scaled(20)):
        model = LM()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(6):
            x = torch.randint(0, VOCAB, (4, LENGTH))
            if state().rank == 1 and step == 3:
                os.kill(os.getpid(), signal.SIGSTOP)
            loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
