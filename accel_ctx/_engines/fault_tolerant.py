"""Fault-tolerant replica groups: torchft's Manager across the groups, DDP inside each.

``accel-ctx launch --replica-groups R`` starts R groups, each its own job (its own process
group and restarts), told the lighthouse's address. ``distributed()`` opens a
:class:`ReplicaGroupRuntime` beside its runtime: each step has a quorum of the live groups
(torchft's ``Manager.start_quorum``, which heals a group that comes back from a peer), the
gradients DDP averaged in the group are averaged over the quorum (``Manager.allreduce``), and
``opt.step()`` runs only when ``Manager.should_commit()`` says every group's part succeeded; a
step whose collective failed is not committed nor counted, and the survivors go on.

Each step's quorum is kept by ``replica_quorum.GroupQuorum``, this runtime's base.

At each new quorum id (every member reads it alike) the groups compare their scripts, models,
sizes and data (``replica_check``) before any gradient is averaged. The gradients are averaged
over the groups by the end of ``loss.backward()``, as DDP's are (so clipping and the loop's
reads see the average): in a group of one rank bucket by bucket during the backward
(``replica_average``), else after the group's own engine has finished. A group whose quorum id
jumped was left out meanwhile and says so; a group whose loop ends first says so as its scope
closes (one more quorum, its row marked finished), so that the others do not report a failure.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from .._job.job import Job
from .._kernel import state as _state
from .._kernel.concern import ForwardCall
from .._kernel.order import ORDER
from .._kernel.session import OptimizerRecord, Session
from ..errors import ConfigurationError
from . import replica_check as _check
from . import replica_events as _events
from .buckets import local_shard
from .replica_average import BackwardAverage, average_now
from .replica_client import Healing, mark_joined
from .replica_quorum import GroupQuorum


class ReplicaGroupRuntime(GroupQuorum):
    """One replica group's side of the job: its Manager, and the hooks that step through it."""

    slot, order = "replica_groups", ORDER["replica_groups"]

    def __init__(self, job: Job, exits: ExitStack, healing: Healing) -> None:
        super().__init__(job, exits, healing)
        # a step is its backward count and its quorum's number (torch.autograd.backward, not
        # patched, counts no backward): its commit, and whether its gradients are averaged
        self._decided: tuple[tuple[int, int], bool] | None = None
        self._averaged = (-1, -1)
        self._checked_quorum = -1  # checked at each new quorum id (the module docstring)
        # a group of one rank has no DDP engine: its backward starts the average bucket by bucket
        self._overlap = BackwardAverage(self._reduce, job.options.bucket_cap_mb) if (
            job.world_size == 1) else None
        if self._overlap is not None:
            exits.callback(self._overlap.close)
        exits.push(self._leave)  # before the shutdown: the others hear that it finished
        mark_joined(job.rank)

    def _leave(self, kind: Any, error: Any, trace: Any) -> bool:
        """At the scope's end without an error: tell the last quorum's groups that this one
        finished (its row in one more check, at a new quorum id), so that they do not report a
        failure; not under local_sgd() (its groups meet at syncs) nor after an error."""
        if kind is not None or self._local or len(self._members) < 2:
            return False
        try:
            self._settle()
            if not self._open:
                # a commit failure to report makes the lighthouse give the next quorum a new id
                self.manager._commit_failures = max(1, int(self.manager._commit_failures))
                self._open, self._gathering = True, True
                self._start()
                self._gathering = False
            if len(self._members) > 1 and self._quorum_id != self._checked_quorum:
                self._check_same(finished=True)
        except Exception:  # the others are gone or going: they see it leave, as a group that stops
            pass
        return False

    @override
    def writes_checkpoints(self) -> bool:  # the quorum's lowest group: one writes the folder
        return not self._members or self.group == min(self._members)

    # ---- meeting objects ---------------------------------------------------------------------------
    @override
    def loader_met(self, loader: Any, record: Any, session: Session) -> None:
        self.healing.met_loader(loader, record)
        if torch.is_grad_enabled() and not self._members:
            self._quorum()  # the first step's quorum: a healing group's position applies

    @override
    def before_batch(self, session: Session) -> None:
        if torch.is_grad_enabled() and self._members:  # a training batch: the step's quorum
            loaders = session.loaders
            if not self._open and loaders and loaders[-1].at_end:
                # the epoch's end, before the next is planned (a healing peer's state is taken
                # here): a loop that ends here has joined the others' next step, so this
                # quorum gets a new id (a commit failure reported) and every group checks at
                # it, where a finishing group's row says it finished (one small all-reduce
                # per epoch)
                self.manager._commit_failures = max(1, int(self.manager._commit_failures))
            self._quorum()

    @override
    def before_forward(self, call: ForwardCall, session: Session) -> None:
        if not call.grad:
            return
        module = call.module
        if any(p.requires_grad for p in module.parameters()):
            self.healing.met("models", module)
        self._quorum()

    @override
    def first_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.healing.met("optimizers", optimizer)

    @override
    def before_schedule(self, scheduler: Any, session: Session) -> None:
        self.healing.met("schedulers", scheduler)

    # ---- the step ---------------------------------------------------------------------------------
    def _reduce(self, flat: torch.Tensor) -> Any:
        return self.manager.allreduce(flat)  # torchft's: its errors reported, not raised

    def _averages(self, stack: _state.Stack | None) -> bool:
        """Whether the backward under way makes a step's gradients (not a local step, none
        inside no_sync(), none mid accumulation group)."""
        return stack is not None and not self.steps_locally(stack) and (
            "sync" not in stack.slots) and not any(d() for d in stack.hooks.defers_clipping)

    def _grads(self) -> list[torch.Tensor]:
        # sharded(): each rank's shard of a gradient, with the same rank of every other group
        # (torchft's HSDP: FSDP2 reduce-scattered inside the group already)
        with torch.no_grad():
            return [local_shard(p.grad) for m in self.healing.models() for p in m.parameters()
                    if p.grad is not None]

    def _ready(self) -> None:
        """The quorum (if none is open) taken, and the groups' check where it changed: before
        the first gradient of the step is averaged."""
        self._quorum()
        self._settle()
        if self._quorum_id != self._checked_quorum or self._quorum_id < 0:
            self._check_same()

    @override
    def before_backward(self, loss: torch.Tensor, session: Session) -> torch.Tensor:
        stack = _state.current()
        if self._overlap is not None and "accumulate" not in (stack.slots if stack else {}) and (
                self._averages(stack)):
            params = [p for m in self.healing.models() for p in m.parameters() if p.requires_grad]
            if all(p.device.type == "cpu" and type(p) is nn.Parameter for p in params):
                # torchft's gloo group on CPU tensors from this thread (a CUDA backward's hooks
                # run on autograd's device threads: averaged after it, below)
                self._ready()
                self._overlap.arm(params)
        return loss

    @override
    def backward_failed(self, exc: Exception) -> None:
        if self._overlap is not None:
            self._overlap.abandon()

    @override
    def after_backward(self, session: Session, params: Any) -> None:
        overlap, stack = self._overlap, _state.current()
        if not self._averages(stack):
            if overlap is not None and overlap.armed:
                overlap.abandon()
            return
        if overlap is not None and overlap.finish():
            self._averaged = self._mark(stack)
        else:
            self._average_step(stack)

    def _mark(self, stack: _state.Stack | None) -> tuple[int, int]:
        return (stack.session.backward_calls if stack is not None else -1, self._asks)

    def _average_step(self, stack: _state.Stack | None) -> None:
        """The step's gradients averaged over the groups at once, and marked so."""
        self._ready()
        average_now(self._grads(), self._reduce)
        self._averaged = self._mark(stack)

    @override
    def grads_for_clipping(self, session: Session, params: list[torch.Tensor]) -> None:
        # a backward the patch did not see (torch.autograd.backward): averaged before the clip
        stack = _state.current()
        if self._averages(stack) and self._averaged != self._mark(stack):
            self._average_step(stack)

    @override
    def allows_step(self, record: OptimizerRecord) -> bool:
        # once per step, however many optimizers take it: the vote
        stack = _state.current()
        if self.steps_locally(stack):  # local steps: local_sgd() syncs by average_over_groups
            return True
        mark = self._mark(stack)
        if self._decided is not None and self._decided[0] == mark:
            return self._decided[1]
        if self._averaged != mark:  # its backward averaged nothing (inside no_sync(), say)
            self._average_step(stack)
        commit = self._vote("step", "its update is dropped in every group, and the next batch "
                            "goes on.")
        self._decided = (mark, commit)
        return commit

    def _vote(self, what: str, outcome: str) -> bool:
        """torchft's commit vote (did every group's part succeed?), and the line when not."""
        number = int(self.manager.current_step()) + 1
        commit = bool(self.manager.should_commit())
        self.participants = int(self.manager.num_participants())
        self._open = False  # the next training batch forms the next quorum
        if not commit and self._failure == _events.FINISHED:
            return commit  # said as the group's finish, not as a failure
        if not commit:
            error = self.manager.errored()
            if self._failure is None and error is not None:  # a mismatch found first stays
                first = str(error.original_exception).splitlines()[0][:160]
                self._failure = f"its part of {what} {number} failed: {first}"
            self._say(f"{what} {number} was not committed ({self._failure or 'a group failed'})"
                      f": {outcome}")
        return commit

    def _check_same(self, finished: bool = False) -> None:
        """One small all-reduce when the quorum changes: the groups run the same script and
        models (else the gradient all-reduce would mix tensors of other shapes); ``finished``:
        this group's loop ended, and its row says so."""
        rows = _check.fingerprints(self.group, self.groups, self.healing.models(),
                                   self.healing.folder(), self.healing.loaders(),
                                   lambda t: self.manager.allreduce(t).wait(),
                                   self.manager.num_participants(), finished)
        if self.manager.errored() is not None or finished:
            return  # a group left meanwhile: this step fails, the next quorum (a new id) checks
        done = sorted(g for g, row in rows.items() if row[0] == _check.FINISHED)
        if done:
            # not a failure: the step under way is dropped in every group (the finished ones
            # take no part in its all-reduce), and the next one is taken without them
            staying = self._members - set(done)
            self._finished |= set(done)
            if self.group == min(staying, default=self.group):
                self._say(_events.finished(done, self._step(), len(staying)))
            self._failure = _events.FINISHED
            self.manager.report_error(RuntimeError(_events.FINISHED))
            return
        wrong = _check.differing(rows, self._members)
        if self.group in wrong:
            raise ConfigurationError(_check.message(self.group, rows, self._members))
        if wrong:
            # not mixed with a gradient of another shape: this step is dropped in every group
            self._failure = _check.message(wrong[0], rows, self._members).split(":")[0]
            self.manager.report_error(ConfigurationError(self._failure))
            return  # the step fails in this group: the next quorum has a new id, checked again
        self._checked_quorum = self._quorum_id

    # ---- state() ---------------------------------------------------------------------------------
    @override
    def snapshot(self) -> dict[str, Any]:
        self._settle()  # read during a step: its quorum's groups, as if it formed before it
        values = {"replica_group": self.group, "replica_groups": self.participants}
        stack = _state.current()
        if not self.steps_locally(stack):  # else each step is taken: the session's
            # before the first quorum: the step resumable() restored
            restored = stack.session.step if stack is not None else 0
            values["step"] = max(int(self.manager.current_step()), restored)
        return values

    # ---- local_sgd() over the groups -------------------------------------------------------------
    @override
    def average_over_groups(self, tensors: list[torch.Tensor]) -> bool:
        """``local_sgd()``'s sync: ``tensors`` averaged in place over the groups in the quorum
        (formed at the period's first batch, or here), then the commit vote. False: a group
        failed in it, ``tensors`` hold nothing meaningful (the caller keeps its own values)."""
        self._local = True
        self._ready()
        average_now(tensors, self._reduce)
        return self._vote("local_sgd()'s synchronisation", "every group keeps its own weights, "
                          "and the next period goes on.")
