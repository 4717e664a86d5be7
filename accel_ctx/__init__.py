"""accel_ctx: a plain PyTorch training loop on any hardware, by wrapping it in scopes.

Importing patches nothing; the scopes patch PyTorch while they are open, in their own thread.

Examples:
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

if TYPE_CHECKING:  # the real imports, for type checkers; at run time each name loads on use
    from ._accumulate import accumulate, no_sync
    from ._batch_size import find_executable_batch_size
    from ._broadcast import broadcast, broadcast_object
    from ._checkpoint import Resumed, load_state, save_model, save_state
    from ._clip import clip_grad_norm_, clip_grad_value_
    from ._collectives import gather, gather_object, pad_across_processes, reduce
    from ._comm_hook import PowerSGD
    from ._decide import all_ranks, any_rank, synchronize_rng_states
    from ._distributed import DistributedOptions, distributed
    from ._evaluation import gather_for_metrics, split_between_processes
    from ._launch.fn import launch
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

__all__ = [
    "DistributedOptions",
    "PowerSGD",
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

# Every public name loads its module on first use: `import accel_ctx` costs next to nothing and
# imports no torch (the `accel-ctx` command's --help and config rely on it), and
# `from accel_ctx import distributed` loads only what it needs.
_HOMES = {
    "accumulate": "_accumulate",
    "no_sync": "_accumulate",
    "find_executable_batch_size": "_batch_size",
    "broadcast": "_broadcast",
    "broadcast_object": "_broadcast",
    "Resumed": "_checkpoint",
    "load_state": "_checkpoint",
    "save_model": "_checkpoint",
    "save_state": "_checkpoint",
    "clip_grad_norm_": "_clip",
    "clip_grad_value_": "_clip",
    "gather": "_collectives",
    "gather_object": "_collectives",
    "pad_across_processes": "_collectives",
    "reduce": "_collectives",
    "PowerSGD": "_comm_hook",
    "all_ranks": "_decide",
    "any_rank": "_decide",
    "synchronize_rng_states": "_decide",
    "DistributedOptions": "_distributed",
    "distributed": "_distributed",
    "gather_for_metrics": "_evaluation",
    "split_between_processes": "_evaluation",
    "launch": "_launch.fn",
    "get_logger": "_logging",
    "main_print": "_logging",
    "load_loader_state": "_position",
    "loader_state": "_position",
    "skip_first_batches": "_position",
    "PrecisionPolicy": "_precision",
    "autocast_forward": "_precision",
    "mixed_precision": "_precision",
    "main_process_first": "_process",
    "on_last_process": "_process",
    "on_local_main_process": "_process",
    "on_main_process": "_process",
    "on_process": "_process",
    "wait_for_everyone": "_process",
    "sharded": "_sharded",
    "State": "_status",
    "state": "_status",
    "log_metrics": "_watch",
    "progress": "_watch",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    value.__module__ = __name__  # reprs and docs show the public path
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
