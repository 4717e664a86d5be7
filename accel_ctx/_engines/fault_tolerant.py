"""Fault-tolerant replica groups: torchft's Manager across the groups, DDP inside each.

``accel-ctx launch --replica-groups R`` starts R groups of processes, each its own job (its own
process group, its own restarts), told the lighthouse's address. Inside, ``distributed()`` opens
a :class:`ReplicaGroupRuntime` beside its own runtime: each step begins with a quorum of the
groups that are alive (torchft's ``Manager.start_quorum``, which also heals a group that comes
back, from a live peer's state), the gradients DDP averaged inside the group are averaged over
the groups in the quorum (``Manager.allreduce``), and ``opt.step()`` runs only when
``Manager.should_commit()`` says every group's part of the step succeeded. A step whose
collective failed (a group died in it) is not committed and not counted; the survivors go on.
"""

from __future__ import annotations

import weakref
from contextlib import ExitStack
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from typing_extensions import override

from .._job.job import Job
from .._kernel import state as _state
from .._kernel.concern import Concern, ForwardCall
from .._kernel.session import OptimizerRecord, Session
from ..errors import ConfigurationError
from .buckets import reduce_in_buckets

_NO_TORCHFT = (
    "this process was started in a replica group (TORCHFT_LIGHTHOUSE is set: accel-ctx launch "
    "--replica-groups), which needs torchft: pip install 'accel-ctx[ft]' (torchft>=0.2), or "
    "launch without --replica-groups.")
TIMEOUT = timedelta(seconds=30)
"""How long a cross-group collective, a commit vote or a state transfer may take: a group that
died mid-step costs the survivors at most this (gloo usually notices a dead peer at once)."""


def _torchft() -> Any:
    try:
        import torchft
    except ImportError as exc:
        raise ConfigurationError(_NO_TORCHFT) from exc
    return torchft


class ReplicaGroupRuntime(Concern):
    """One replica group's side of the job: its Manager, and the hooks that step through it."""

    # after accumulate (10) and local_sgd (40): it sees only the steps that are taken
    slot, order = "replica_groups", 50

    def __init__(self, job: Job, exits: ExitStack) -> None:
        torchft = _torchft()
        launch = job.launch
        self.group, self.groups = launch.replica_group, launch.replica_groups
        # what a healing peer receives, in the order this process met them (the same script
        # meets them in the same order in every group)
        self._models: list[weakref.ref[nn.Module]] = []
        self._optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        self._pending: list[dict[str, Any]] = []  # optimizer states received before they were met
        self._open = False  # a quorum was formed for the step under way
        self._decided: tuple[int, bool] | None = None  # (backward count, commit) of this step
        self.participants = self.groups
        pg = torchft.ProcessGroupGloo(timeout=TIMEOUT)

        def make() -> Any:
            return torchft.Manager(
                pg=pg, load_state_dict=self._load, state_dict=self._state,
                min_replica_size=1, use_async_quorum=False,  # heal before the forward
                timeout=TIMEOUT, quorum_timeout=TIMEOUT, connect_timeout=TIMEOUT,
                rank=job.rank, world_size=job.world_size, lighthouse_addr=launch.lighthouse,
                replica_id=f"accel_ctx_{self.group}")

        if job.world_size > 1 and dist.is_initialized():
            # rank 0 publishes its manager's address in the group's store: the others read it
            # only after, never a stale one from before a restart
            manager = make() if job.rank == 0 else None
            dist.barrier()
            self.manager = manager if manager is not None else make()
        else:
            self.manager = make()
        exits.callback(self.manager.shutdown, wait=False)

    # ---- healing: what a peer sends, and loading it ----------------------------------------------
    def _state(self) -> dict[str, Any]:
        models = [m() for m in self._models]
        optimizers = [o() for o in self._optimizers]
        return {"models": [m.state_dict() for m in models if m is not None],
                "optimizers": [o.state_dict() for o in optimizers if o is not None]}

    def _load(self, state: dict[str, Any]) -> None:
        models = [m for m in (ref() for ref in self._models) if m is not None]
        for model, saved in zip(models, state["models"], strict=False):
            model.load_state_dict(saved)
        optimizers = [o for o in (ref() for ref in self._optimizers) if o is not None]
        saved_optimizers = list(state["optimizers"])
        for optimizer, saved in zip(optimizers, saved_optimizers, strict=False):
            optimizer.load_state_dict(saved)
        self._pending = saved_optimizers[len(optimizers):]  # for optimizers met later

    # ---- the step ----------------------------------------------------------------------------------
    def _quorum(self) -> None:
        if not self._open:
            self._open = True
            self.manager.start_quorum()  # may heal this group from a peer (use_async_quorum off)

    @override
    def before_forward(self, call: ForwardCall, session: Session) -> None:
        if not call.grad:
            return
        module = call.module
        if all(ref() is not module for ref in self._models) and any(
                p.requires_grad for p in module.parameters()):
            self._models.append(weakref.ref(module))
        self._quorum()

    @override
    def first_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizers.append(weakref.ref(optimizer))
        if self._pending:
            optimizer.load_state_dict(self._pending.pop(0))

    @override
    def allows_step(self, record: OptimizerRecord) -> bool:
        # once per step, however many optimizers take it: average over the groups, then vote
        stack = _state.current()
        mark = stack.session.backward_calls if stack is not None else -1
        if self._decided is not None and self._decided[0] == mark:
            return self._decided[1]
        self._quorum()
        self._average()
        commit = bool(self.manager.should_commit())
        self.participants = int(self.manager.num_participants())
        self._open = False
        self._decided = (mark, commit)
        return commit

    def _average(self) -> None:
        grads = [p.grad for ref in self._models if (m := ref()) is not None
                 for p in m.parameters() if p.grad is not None]
        # one all-reduce per device and dtype, averaged over the groups in the quorum
        reduce_in_buckets(grads, lambda flat: self.manager.allreduce(flat).wait())

    # ---- state() ---------------------------------------------------------------------------------
    @override
    def snapshot(self) -> dict[str, Any]:
        return {"replica_group": self.group, "replica_groups": self.participants,
                "step": int(self.manager.current_step())}
