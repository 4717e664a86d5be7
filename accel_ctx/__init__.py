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
import re
from importlib import metadata
from typing import TYPE_CHECKING, Any

from . import errors

# The oldest torch the compat tier passes on (./dev compat; pyproject.toml's torch>= says the
# same, a test holds them equal). Read from torch's metadata, not by importing it: `import
# accel_ctx` loads no torch, and an older one should fail here, not deep inside a scope.
_TORCH_FLOOR = (2, 11)


def _check_torch() -> None:
    try:
        installed = metadata.version("torch")
    except metadata.PackageNotFoundError:  # none installed (the launcher's --help needs none)
        return
    found = re.match(r"(\d+)\.(\d+)", installed)
    if found is None or (int(found[1]), int(found[2])) >= _TORCH_FLOOR:
        return  # a build with an odd version string is let through to speak for itself
    floor = ".".join(map(str, _TORCH_FLOOR))
    raise errors.UnsupportedTorchError(
        f"accel_ctx needs torch {floor} or newer; this environment has torch {installed}. "
        f"Upgrade it (python -m pip install 'torch>={floor}', the build for your CUDA), or run "
        f"accel_ctx in an environment with a newer torch.")


_check_torch()

if TYPE_CHECKING:  # the real imports, for type checkers; at run time each name loads on use
    from ._checkpoint import Resumed, load_state, save_model, save_state
    from ._data.position import load_loader_state, loader_state, skip_first_batches
    from ._job.comm_hook import PowerSGD
    from ._launch.fn import launch
    from ._precision.runtime import PrecisionPolicy
    from ._ranks.batch_size import find_executable_batch_size
    from ._ranks.broadcast import broadcast, broadcast_object
    from ._ranks.collectives import gather, gather_object, pad_across_processes, reduce
    from ._ranks.decide import all_ranks, any_rank, synchronize_rng_states
    from ._ranks.evaluation import gather_for_metrics, split_between_processes
    from ._ranks.logging import get_logger, main_print
    from ._ranks.process import on_last_process, on_local_main_process, on_main_process, on_process
    from ._ranks.sync import main_process_first, wait_for_everyone
    from ._ranks.watch import log_metrics, progress
    from ._scopes.accumulate import accumulate, no_sync
    from ._scopes.distributed import DistributedOptions, distributed
    from ._scopes.local_sgd import local_sgd
    from ._scopes.mixed_precision import autocast_forward, mixed_precision
    from ._scopes.resumable import resumable
    from ._scopes.sharded import sharded
    from ._scopes.status import State, state
    from ._steps.clip import clip_grad_norm_, clip_grad_value_

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
    "local_sgd",
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
    "resumable",
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
    "accumulate": "_scopes.accumulate",
    "no_sync": "_scopes.accumulate",
    "find_executable_batch_size": "_ranks.batch_size",
    "broadcast": "_ranks.broadcast",
    "broadcast_object": "_ranks.broadcast",
    "Resumed": "_checkpoint",
    "load_state": "_checkpoint",
    "save_model": "_checkpoint",
    "save_state": "_checkpoint",
    "resumable": "_scopes.resumable",
    "clip_grad_norm_": "_steps.clip",
    "clip_grad_value_": "_steps.clip",
    "gather": "_ranks.collectives",
    "gather_object": "_ranks.collectives",
    "pad_across_processes": "_ranks.collectives",
    "reduce": "_ranks.collectives",
    "PowerSGD": "_job.comm_hook",
    "all_ranks": "_ranks.decide",
    "any_rank": "_ranks.decide",
    "synchronize_rng_states": "_ranks.decide",
    "DistributedOptions": "_scopes.distributed",
    "distributed": "_scopes.distributed",
    "local_sgd": "_scopes.local_sgd",
    "gather_for_metrics": "_ranks.evaluation",
    "split_between_processes": "_ranks.evaluation",
    "launch": "_launch.fn",
    "get_logger": "_ranks.logging",
    "main_print": "_ranks.logging",
    "load_loader_state": "_data.position",
    "loader_state": "_data.position",
    "skip_first_batches": "_data.position",
    "PrecisionPolicy": "_precision.runtime",
    "autocast_forward": "_scopes.mixed_precision",
    "mixed_precision": "_scopes.mixed_precision",
    "main_process_first": "_ranks.sync",
    "on_last_process": "_ranks.process",
    "on_local_main_process": "_ranks.process",
    "on_main_process": "_ranks.process",
    "on_process": "_ranks.process",
    "wait_for_everyone": "_ranks.sync",
    "sharded": "_scopes.sharded",
    "State": "_scopes.status",
    "state": "_scopes.status",
    "log_metrics": "_ranks.watch",
    "progress": "_ranks.watch",
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
