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

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import errors
from ._accumulate import accumulate, no_sync
from ._batch_size import find_executable_batch_size
from ._broadcast import broadcast, broadcast_object
from ._clip import clip_grad_norm_, clip_grad_value_
from ._collectives import gather, gather_object, pad_across_processes, reduce
from ._decide import all_ranks, any_rank, synchronize_rng_states
from ._distributed import DistributedOptions, distributed
from ._evaluation import gather_for_metrics, split_between_processes
from ._logging import get_logger, main_print
from ._position import load_loader_state, loader_state, skip_first_batches
from ._precision import PrecisionPolicy, autocast_forward, mixed_precision
from ._process import (
    main_process_first,
    on_last_process,
    on_local_main_process,
    on_main_process,
    on_process,
    wait_for_everyone,
)
from ._sharded import sharded
from ._status import State, state
from ._watch import log_metrics, progress

if TYPE_CHECKING:
    from ._checkpoint import Resumed, load_state, save_model, save_state
    from ._launch.fn import launch

__all__ = [
    "DistributedOptions",
    "PrecisionPolicy",
    "Resumed",
    "State",
    "accumulate",
    "all_ranks",
    "any_rank",
    "autocast_forward",
    "broadcast",
    "broadcast_object",
    "clip_grad_norm_",
    "clip_grad_value_",
    "distributed",
    "errors",
    "find_executable_batch_size",
    "gather",
    "gather_for_metrics",
    "gather_object",
    "get_logger",
    "launch",
    "load_loader_state",
    "load_state",
    "loader_state",
    "log_metrics",
    "main_print",
    "main_process_first",
    "mixed_precision",
    "no_sync",
    "on_last_process",
    "on_local_main_process",
    "on_main_process",
    "on_process",
    "pad_across_processes",
    "progress",
    "reduce",
    "save_model",
    "save_state",
    "sharded",
    "skip_first_batches",
    "split_between_processes",
    "state",
    "synchronize_rng_states",
    "wait_for_everyone",
]

__version__ = "0.1.0"

for _name in ("State", "state", "distributed", "DistributedOptions", "mixed_precision",
              "PrecisionPolicy", "autocast_forward", "accumulate", "no_sync", "sharded",
              "clip_grad_norm_", "clip_grad_value_",
              "on_main_process", "on_local_main_process", "on_process", "on_last_process",
              "main_process_first", "wait_for_everyone", "main_print", "gather", "gather_object",
              "reduce", "broadcast", "broadcast_object", "pad_across_processes",
              "gather_for_metrics", "split_between_processes", "get_logger", "any_rank",
              "all_ranks", "synchronize_rng_states", "loader_state", "load_loader_state",
              "skip_first_batches", "find_executable_batch_size", "progress", "log_metrics"):
    globals()[_name].__module__ = __name__
del _name

# The checkpoint and launcher wings load on first use, so `import accel_ctx` stays cheap.
_LAZY = {"Resumed": "_checkpoint", "save_state": "_checkpoint", "load_state": "_checkpoint",
         "save_model": "_checkpoint", "launch": "_launch.fn"}


def __getattr__(name: str) -> Any:
    home = _LAZY.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    value.__module__ = __name__
    globals()[name] = value
    return value
