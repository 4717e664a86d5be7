"""``state()``: a read-only snapshot of where this process stands, read from the open scopes.

Each open concern contributes its own fields (:meth:`~accel_ctx._kernel.concern.Concern.snapshot`):
the distributed runtime its job's coordinates and device, the precision its policy, the
accumulation its group. Nothing here knows a concern by name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from typing_extensions import override

from .._job import env as _env
from .._job.coordinates import Coordinates
from .._job.job import Job, process_job
from .._kernel import state as _state
from .._kernel.concern import LossScaling
from .._kernel.session import Session
from .._options import checked
from .._warn import warn_user


class _DeviceCounts:
    """What a snapshot knows of values the device holds, read only when asked (a host sync)."""

    def __init__(self, session: Session, scaling: LossScaling | None) -> None:
        # the scale as it is now (a copy: the scaler updates its own in place)
        self._scale = scaling.current_scale() if scaling is not None else None
        self._known = session.skipped_steps
        self._unread = session.unread_counts()
        self._read: int | None = None

    def loss_scale(self) -> float | None:
        return None if self._scale is None else float(self._scale)

    def skipped_steps(self) -> int:
        if self._read is None:
            self._read = self._known + sum(int(n.item()) for n in self._unread)
        return self._read


@dataclass(frozen=True)
class State(Coordinates):
    """A read-only snapshot of where this process stands, taken by :func:`state`.

    Its first fields are the job's :class:`Coordinates` (``rank``, ``world_size``,
    ``local_rank``, ``local_world_size``, ``node_rank``, ``num_nodes``, ``dp_rank``,
    ``dp_size``, ``tp_rank``, ``tp_size``, ``sp_rank``, ``sp_size``, ``pp_rank``, ``pp_size``:
    rank 0 of 1 outside ``distributed()``; under ``tp=N``, ``sp=N`` or ``pp=N`` the
    data-parallel fields count groups); the
    scopes' settings follow.
    """
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where ``distributed()`` puts modules and batches."""
    backend: str | None = None
    """The process group's backend (None for one process)."""
    distributed: bool = False
    """Inside a ``distributed()`` scope (of this thread: a helper thread of a rank sees the
    rank's coordinates, but no scope)."""
    mixed_precision: str = "no"
    """The active precision policy: 'bf16', 'fp16', 'fp8' or 'no' (autocast), 'bf16-true' or
    'fp16-true' (the model itself in half)."""
    accumulation_steps: int = 1
    """Micro-batches per optimizer step."""
    sync_gradients: bool = True
    """Whether the last backward closed an accumulation group (a real optimizer step follows)."""
    step: int = 0
    """Optimizer steps taken in this scope (once per accumulation group, skipped ones included).
    In a replica group: the job's committed steps, the same in every group (a group that healed
    from a peer counts on from the peer's step)."""
    loader: Any = None
    """The DataLoader being iterated by the innermost loop in this scope (None between loops)."""
    batch_index: int = -1
    """0-based index, in this rank's share of the epoch, of the batch ``loader`` handed out last."""
    end_of_loader: bool = False
    """That batch is the last of ``loader``'s epoch on this rank (log, step a scheduler...)."""
    replica_group: int = 0
    """This process's replica group (``accel-ctx launch --replica-groups R``: 0 to R-1)."""
    replica_groups: int = 1
    """Replica groups that took part in the last optimizer step (before the first: as launched)."""
    _device_counts: _DeviceCounts | None = field(default=None, repr=False, compare=False)

    @property
    def loss_scale(self) -> float | None:
        """fp16: the loss scale when the snapshot was taken (updated before the next backward).

        Lives on the device: reading it waits for the device, taking the snapshot does not.
        """
        return self._device_counts.loss_scale() if self._device_counts is not None else None

    @property
    def skipped_steps(self) -> int:
        """fp16: optimizer steps skipped because of inf/NaN gradients.

        A fused optimizer skips on the device: reading the count waits for it.
        """
        return self._device_counts.skipped_steps() if self._device_counts is not None else 0

    @property
    def coordinates(self) -> Coordinates:
        """The job's coordinates alone (the fields the job, its engines and its launcher share)."""
        return Coordinates(**{f.name: getattr(self, f.name) for f in fields(Coordinates)})

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

    @override
    def __repr__(self) -> str:
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.repr]
        shown += [f"loss_scale={self.loss_scale!r}", f"skipped_steps={self.skipped_steps!r}"]
        return f"State({', '.join(shown)})"


def _facts(job: Job) -> dict[str, Any]:
    """What a thread without a scope of its own sees of its process's job: the facts only."""
    return {**job.coordinates.as_dict(), "device": job.device, "backend": job.backend}


_warned_alone = False  # state() outside distributed() in a replica group: said once


def _warn_outside_replica_group() -> None:
    """Warn once where a process started in a replica group reads state() with no
    ``distributed()`` open: it answers for a lone process, and ``while state().step < N``
    would never end (nothing outside the scope advances the job's step)."""
    global _warned_alone
    if _warned_alone or not os.environ.get(_env.LIGHTHOUSE_VAR):
        return
    _warned_alone = True
    group = os.environ.get(_env.REPLICA_GROUP_VAR, "?")
    groups = os.environ.get(_env.REPLICA_GROUPS_VAR, "?")
    warn_user(
        f"state() was read outside distributed() in a process of replica group {group} of "
        f"{groups} ({_env.LIGHTHOUSE_VAR} is set: accel-ctx launch --replica-groups): it "
        "answers for this process alone (rank 0 of 1, and a step no step of the job advances: "
        "`while state().step < N` would never end), and the groups do not train together. "
        "Open `with distributed():` around the training loop: inside it the groups train one "
        "model and state().step counts the job's committed steps.")


@checked
def state() -> State:
    """Where this process stands: rank, world size, device and the active settings.

    Read when called, so it follows the scopes: outside any scope it answers for a single
    process (rank 0 of 1, on the CPU).

    Examples:
        >>> from accel_ctx import distributed, state
        >>> state().world_size
        1
        >>> with distributed():
        ...     s = state()
        >>> s.rank, s.is_main_process
        (0, True)
    """
    stack = _state.current()
    values: dict[str, Any] = {}
    if stack is None or stack.job is None:
        job = process_job()  # a helper thread of a rank: its process's coordinates
        if job is not None:
            values.update(_facts(job))
        else:
            _warn_outside_replica_group()
    if stack is None:
        return State(**values)
    values["step"] = stack.session.step
    iteration = stack.session.active_loader()
    if iteration is not None:
        values.update(loader=iteration.loader, batch_index=iteration.index,
                      end_of_loader=iteration.at_end)
    scaling = None
    for concern in stack.concerns:  # each open concern's own fields
        values.update(concern.snapshot())
        scaling = scaling or concern.loss_scaling()
    values["_device_counts"] = _DeviceCounts(stack.session, scaling)
    return State(**values)
