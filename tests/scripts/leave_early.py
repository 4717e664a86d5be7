"""Rank 1 leaves the training loop (and distributed()) at step 3 and exits normally."""

import torch

from accel_ctx import distributed, state
from tests._timeouts import scaled  # a busy machine: the tests' factor

with distributed(timeout=scaled(60)):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(6):
        if state().rank == 1 and step == 3:
            break
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
