"""pp=2: the last stage fails in its forward at step 3 while the first stage waits for its
output, as argv[1] says: "dies" (os._exit) or "stops" (SIGSTOP). The first stage must end
soon (a stop: within distributed(timeout=...)), naming rank 1."""

import os
import signal
import sys

import torch
import torch.nn.functional as F

from accel_ctx import distributed, state
from tests._timeouts import scaled  # a busy machine: the tests' factor
from tests.workers.pipeline import LENGTH, LM, VOCAB

if __name__ == "__main__":
    dies = sys.argv[1] == "dies"
    torch.manual_seed(0)
    with distributed(pp=2, timeout=scaled(60 if dies else 20)):
        model = LM()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(6):
            x = torch.randint(0, VOCAB, (4, LENGTH))
            if state().rank == 1 and step == 3:
                if dies:
                    os._exit(3)
                os.kill(os.getpid(), signal.SIGSTOP)
            loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
