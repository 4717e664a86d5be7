"""``state()``: a read-only snapshot of where this process stands, read from the open scopes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from . import _state
from ._accumulate import AccumulateRuntime
from ._precision import PrecisionRuntime


@dataclass(frozen=True)
class State:
    """A read-only snapshot of where this process stands, taken by :func:`state`."""

    rank: int = 0
    """This process's index in the job (0 outside ``distributed()``)."""
    world_size: int = 1
    """Processes in the job."""
    local_rank: int = 0
    """Index among the processes on this machine."""
    local_world_size: int = 1
    """Processes on this machine."""
    node_rank: int = 0
    """Index of this machine."""
    num_nodes: int = 1
    """Machines in the job."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where ``distributed()`` puts modules and batches."""
    backend: str | None = None
    """The process group's backend (None for one process)."""
    distributed: bool = False
    """Inside a ``distributed()`` scope."""
    mixed_precision: str = "no"
    """The active precision policy: 'bf16', 'fp16' or 'no'."""
    loss_scale: float | None = None
    """fp16: the current loss scale (updated before the next backward)."""
    skipped_steps: int = 0
    """fp16: optimizer steps skipped because of inf/NaN gradients."""
    accumulation_steps: int = 1
    """Micro-batches per optimizer step."""
    sync_gradients: bool = True
    """Whether the last backward closed an accumulation group (a real optimizer step follows)."""
    step: int = 0
    """Optimizer steps taken in this scope (once per accumulation group, skipped ones included)."""
    loader: Any = None
    """The DataLoader being iterated by the innermost loop in this scope (None between loops)."""
    batch_index: int = -1
    """0-based index, in this rank's share of the epoch, of the batch ``loader`` handed out last."""
    end_of_loader: bool = False
    """That batch is the last of ``loader``'s epoch on this rank (log, step a scheduler...)."""

    @property
    def is_main_process(self) -> bool:
        """Rank 0 of the job."""
        return self.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        """The first process on this machine."""
        return self.local_rank == 0

    @property
    def is_last_process(self) -> bool:
        """The highest rank of the job."""
        return self.rank == self.world_size - 1


def state() -> State:
    """Where this process stands: rank, world size, device and the active settings.

    Read when called, so it follows the scopes: outside any scope it answers for a single
    process (rank 0 of 1, on the CPU).

    Example:
        >>> from accel_ctx import distributed, state
        >>> state().world_size
        1
        >>> with distributed():
        ...     s = state()
        >>> s.rank, s.is_main_process
        (0, True)
    """
    stack = _state.current()
    if stack is None:
        return State()
    values: dict[str, Any] = {"step": stack.session.step, "skipped_steps": stack.session.skipped_steps}
    job = stack.job
    if job is not None:
        launch, where = job.launch, job.coordinates
        values.update(
            rank=where.rank,
            world_size=where.world_size,
            local_rank=where.local_rank,
            local_world_size=where.local_world_size,
            node_rank=launch.node_rank,
            num_nodes=launch.num_nodes,
            device=job.device,
            backend=job.backend,
            distributed=True,
        )
    iteration = stack.session.active_loader()
    if iteration is not None:
        values.update(loader=iteration.loader, batch_index=iteration.index,
                      end_of_loader=iteration.at_end)
    precision = stack.find(PrecisionRuntime)
    if precision is not None:
        values.update(mixed_precision=precision.policy.name, loss_scale=precision.loss_scale())
    accumulation = stack.find(AccumulateRuntime)
    if accumulation is not None:
        values.update(
            accumulation_steps=accumulation.steps, sync_gradients=accumulation.sync_gradients
        )
    return State(**values)
