"""accel_ctx: a plain PyTorch training loop on any hardware, by wrapping it in scopes.

Importing patches nothing; the scopes patch PyTorch while they are open, in their own thread.

Example:
    >>> import torch
    >>> from accel_ctx import distributed, mixed_precision, state
    >>> with distributed(), mixed_precision("bf16"):
    ...     model = torch.nn.Linear(4, 2)
    ...     loss = model(torch.randn(8, 4)).pow(2).mean()
    ...     loss.backward()
    >>> state().world_size
    1
"""

from . import errors
from ._accumulate import accumulate, no_sync
from ._clip import clip_grad_norm_, clip_grad_value_
from ._distributed import DistributedOptions, distributed
from ._precision import PrecisionPolicy, autocast_forward, mixed_precision
from ._state import State, state

__all__ = [
    "DistributedOptions",
    "PrecisionPolicy",
    "State",
    "accumulate",
    "autocast_forward",
    "clip_grad_norm_",
    "clip_grad_value_",
    "distributed",
    "errors",
    "mixed_precision",
    "no_sync",
    "state",
]

__version__ = "0.1.0"

for _name in ("State", "state", "distributed", "DistributedOptions", "mixed_precision",
              "PrecisionPolicy", "autocast_forward", "accumulate", "no_sync",
              "clip_grad_norm_", "clip_grad_value_"):
    globals()[_name].__module__ = __name__
del _name
