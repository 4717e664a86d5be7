"""Fault-tolerant replica groups: torchft's Manager across the groups, DDP inside each.

``accel-ctx launch --replica-groups R`` starts R groups of processes, each its own job (its own
process group, its own restarts), told the lighthouse's address. Inside, ``distributed()`` opens
a :class:`ReplicaGroupRuntime` beside its own runtime: each step begins with a quorum of the
groups that are alive (torchft's ``Manager.start_quorum``, which also heals a group that comes
back, from a live peer's state), the gradients DDP averaged inside the group are averaged over
the groups in the quorum (``Manager.allreduce``), and ``opt.step()`` runs only when
``Manager.should_commit()`` says every group's part of the step succeeded. A step whose
collective failed (a group died in it) is not committed and not counted; the survivors go on.

The quorum of a step is formed before its first batch is fetched (so a healing group's
DataLoader continues at its peers' position), or at its first forward where no DataLoader
drives the loop. The first quorum waits up to ``ACCEL_CTX_REPLICA_TIMEOUT`` (30 s) for every
group, so that an undisturbed job trains every step with all of them.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from contextlib import ExitStack
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from typing_extensions import override

from .._job.env import replica_marks
from .._job.job import Job
from .._kernel import state as _state
from .._kernel.concern import Concern, ForwardCall
from .._kernel.session import OptimizerRecord, Session
from ..errors import ConfigurationError, RendezvousError
from . import replica_check as _check
from . import replica_events as _events
from . import replica_quiet as _quiet
from .buckets import reduce_in_buckets

# the launcher's hint (_launch.replica_groups, a wing this layer does not import): no PyPI release
FT_INSTALL = ("pip install 'torchft>=0.2' (the package of accel_ctx's ft extra: in the accel_ctx "
              "clone `pip install -e '.[ft]'`, or `pip install 'accel-ctx[ft]'` where accel_ctx "
              "is installed)")
_NO_TORCHFT = (
    "this process was started in a replica group (TORCHFT_LIGHTHOUSE is set: accel-ctx launch "
    "--replica-groups), which needs torchft: " + FT_INSTALL + ", or launch without "
    "--replica-groups.")


def _torchft() -> Any:
    try:
        import torchft
    except ImportError as exc:
        raise ConfigurationError(_NO_TORCHFT) from exc
    return torchft


class Healing(Protocol):
    """The objects a group met and the states a peer sent (``_checkpoint.heal.PeerState``)."""

    source: int

    def folder(self) -> str | None: ...
    def models(self) -> list[nn.Module]: ...
    def met(self, kind: str, obj: Any) -> None: ...
    def met_loader(self, loader: Any, record: Any) -> None: ...
    def state(self, group: int) -> dict[str, Any]: ...
    def load(self, sent: dict[str, Any]) -> None: ...


class _RecordingClient:
    """torchft's manager client, keeping the last quorum (which groups are in it)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.last: Any = None

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        self.last = self._client._quorum(*args, **kwargs)
        return self.last

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def mark_joined(rank: int, folder: str | None = None) -> None:
    """Tell the group's launcher that this rank's replica runtime opened: an empty file
    ``joined-<rank>`` in ``ACCEL_CTX_REPLICA_MARKS`` (or ``folder``), made whole at once (a
    temporary file renamed); nothing where the variable is unset or the folder is gone.

    >>> import os, tempfile
    >>> with tempfile.TemporaryDirectory() as marks:
    ...     mark_joined(1, marks)
    ...     os.listdir(marks)
    ['joined-1']
    """
    folder = folder or replica_marks()
    if folder is None:
        return
    try:
        fd, temporary = tempfile.mkstemp(prefix=".joined-", dir=folder)
        os.close(fd)
        os.replace(temporary, os.path.join(folder, f"joined-{rank}"))
    except OSError:  # the launcher removed its folder (it is ending): nobody reads the mark
        pass


def _group_of(replica_id: str) -> int:
    digits = replica_id.split(":")[0].rsplit("_", 1)[-1]
    return int(digits) if digits.isdigit() else -1


class ReplicaGroupRuntime(Concern):
    """One replica group's side of the job: its Manager, and the hooks that step through it."""

    # after accumulate (10) and local_sgd (40): it sees only the steps that are taken
    slot, order = "replica_groups", 50

    def __init__(self, job: Job, exits: ExitStack, healing: Healing) -> None:
        torchft = _torchft()
        launch = job.launch
        self.group, self.groups = launch.replica_group, launch.replica_groups
        self.address = str(launch.lighthouse)
        self.healing = healing
        self._speaks = job.rank == 0  # one line per event and group
        self._open = False  # a quorum was formed for the step under way
        self._decided: tuple[int, bool] | None = None  # (backward count, commit) of this step
        self._members: frozenset[int] = frozenset()
        # the members whose script and model match, by torchft's replica id (not group index):
        # a group restarted before the others saw it leave keeps its index but comes back as a
        # new Manager (a new id), and every group must check it again (it checks; the others
        # must meet its check, not send their gradients into it)
        self._member_ids: frozenset[str] = frozenset()
        self._checked_ids: frozenset[str] = frozenset()
        self._failure: str | None = None  # why the last step was not committed
        self._gathering = False  # the first quorum waits for every group
        self.participants = 1  # this group alone until a quorum says otherwise
        self._timeout = timeout = _events.timeout()
        pg = torchft.ProcessGroupGloo(timeout=timeout)
        _quiet.quiet_torchft(exits)

        def make() -> Any:
            transport = _quiet.quiet_transport(torchft, timeout)
            try:
                return torchft.Manager(
                    pg=pg, checkpoint_transport=transport, load_state_dict=self.healing.load,
                    state_dict=lambda: self.healing.state(self.group),
                    min_replica_size=1, use_async_quorum=False,  # heal before the batch
                    timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
                    rank=job.rank, world_size=job.world_size, lighthouse_addr=self.address,
                    replica_id=f"accel_ctx_{self.group}")
            except Exception as exc:  # the lighthouse is not there
                transport.shutdown(wait=False)
                raise self._unreachable(exc) from exc

        if job.world_size > 1 and dist.is_initialized():
            # rank 0 publishes its manager's address in the group's store: the others read it
            # only after, never a stale one from before a restart
            manager = make() if job.rank == 0 else None
            dist.barrier()
            self.manager = manager if manager is not None else make()
        else:
            self.manager = make()
        self._client = _RecordingClient(self.manager._client)
        self.manager._client = self._client
        exits.callback(self.manager.shutdown, wait=False)
        mark_joined(job.rank)

    def _unreachable(self, exc: BaseException) -> RendezvousError:
        return _events.unreachable(self.group, self.groups, self.address, exc)

    def _say(self, text: str) -> None:
        if self._speaks:
            print(f"accel-ctx: {text}", file=sys.stderr, flush=True)

    # ---- the quorum --------------------------------------------------------------------------------
    def _quorum(self) -> None:
        if self._open:
            return
        self._open = True
        first = not self._members
        began = time.monotonic()
        stack = _state.current()
        if first and stack is not None and stack.session.step > self.manager.current_step():
            # resumable() restored the job from its folder: every group goes on from that step
            step = stack.session.step
            self.manager.load_state_dict({"step": step, "batches_committed": step * self.groups})
        before = int(self.manager.current_step())
        self._start()  # may heal this group from a peer (use_async_quorum off)
        if first:
            self._gathering = True  # the groups arriving at the start: no line for each
            while (len(self._members) < self.groups and self.manager.current_step() == 0
                   and time.monotonic() - began < self._timeout.total_seconds()):
                time.sleep(0.2)  # the others are still starting: a step with all of them
                self._start()
            self._gathering = False
            missing = sorted(set(range(self.groups)) - self._members)
            if missing and self.manager.current_step() == 0:
                self._say(_events.missing(missing, len(self._members), self.address))
        step = int(self.manager.current_step())
        if step > before and self.healing.source >= 0:
            self._say(_events.healed(self.group, self.healing.source, step,
                                     time.monotonic() - began))
            self.healing.source = -1

    def _start(self) -> None:
        previous = self._members
        try:
            self.manager.start_quorum()
        except Exception as exc:
            raise self._unreachable(exc) from exc
        quorum = self._client.last
        self._members = frozenset(_group_of(r) for r in quorum.replica_ids) if quorum else (
            frozenset({self.group}))
        self._member_ids = frozenset(quorum.replica_ids) if quorum else frozenset()
        self._checked_ids &= self._member_ids  # one that left and comes back is checked again
        self.participants = len(self._members)  # the groups in the step under way
        if not previous or self._gathering:
            return
        step = int(self.manager.current_step())
        left, joined = sorted(previous - self._members), sorted(self._members - previous)
        if self.group != min(self._members & previous, default=self.group):
            left = joined = []  # the lowest group that stayed says it, once
        if left:
            why = self._failure or "it stopped answering the lighthouse"
            self._say(_events.left(left, step, why, len(self._members)))
        if joined:
            self._say(_events.joined(joined, step, len(self._members)))
        self._failure = None

    def writes_checkpoints(self) -> bool:
        """Whether this group writes resumable()'s checkpoints: the lowest group in the quorum
        (one healthy group writes the job's folder; a job that lost every group resumes from
        it)."""
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

    # ---- the step ----------------------------------------------------------------------------------
    @override
    def allows_step(self, record: OptimizerRecord) -> bool:
        # once per step, however many optimizers take it: average over the groups, then vote
        stack = _state.current()
        if self.steps_locally(stack):  # local steps: local_sgd() syncs by average_over_groups
            return True
        mark = stack.session.backward_calls if stack is not None else -1
        if self._decided is not None and self._decided[0] == mark:
            return self._decided[1]
        # sharded(): each rank's shard of a gradient, with the same rank of every other group
        # (torchft's HSDP: FSDP2 reduce-scattered inside the group already)
        with torch.no_grad():
            grads = [_local(p.grad) for m in self.healing.models() for p in m.parameters()
                     if p.grad is not None]
        commit = self._average_and_vote(grads, "step", "its update is dropped in every group, "
                                        "and the next batch goes on.")
        self._decided = (mark, commit)
        return commit

    def _vote(self, what: str, outcome: str) -> bool:
        """torchft's commit vote (did every group's part succeed?), and the line when not."""
        number = int(self.manager.current_step()) + 1
        commit = bool(self.manager.should_commit())
        self.participants = int(self.manager.num_participants())
        self._open = False  # the next training batch forms the next quorum
        if not commit:
            error = self.manager.errored()
            if self._failure is None and error is not None:  # a mismatch found first stays
                first = str(error.original_exception).splitlines()[0][:160]
                self._failure = f"its part of {what} {number} failed: {first}"
            self._say(f"{what} {number} was not committed ({self._failure or 'a group failed'})"
                      f": {outcome}")
        return commit

    def _check_same(self) -> None:
        """One small all-reduce when the quorum changes: the groups run the same script and
        models (else the gradient all-reduce would mix tensors of other shapes)."""
        rows = _check.fingerprints(self.group, self.groups, self.healing.models(),
                                   self.healing.folder(),
                                   lambda t: self.manager.allreduce(t).wait(),
                                   self.manager.num_participants())
        if self.manager.errored() is not None:
            return  # a group left meanwhile: this step fails, the next quorum checks again
        wrong = _check.differing(rows, self._members)
        if self.group in wrong:
            raise ConfigurationError(_check.message(self.group, rows, self._members))
        if wrong:
            # not mixed with a gradient of another shape: this step is dropped in every group
            self._failure = _check.message(wrong[0], rows, self._members).split(":")[0]
            self.manager.report_error(ConfigurationError(self._failure))
        self._checked_ids = frozenset(r for r in self._member_ids if _group_of(r) not in wrong)

    # ---- state() ---------------------------------------------------------------------------------
    @override
    def snapshot(self) -> dict[str, Any]:
        values = {"replica_group": self.group, "replica_groups": self.participants}
        stack = _state.current()
        if not self.steps_locally(stack):  # else each step is taken: the session's
            # before the first quorum: the step resumable() restored
            restored = stack.session.step if stack is not None else 0
            values["step"] = max(int(self.manager.current_step()), restored)
        return values

    # ---- local_sgd() over the groups -------------------------------------------------------------
    @staticmethod
    def steps_locally(stack: _state.Stack | None) -> bool:
        """A ``local_sgd()`` entry is open: each step is the group's own (no quorum, average or
        vote); the groups meet only in :meth:`average_over_groups`."""
        return stack is not None and "local_sgd" in stack.slots

    def average_over_groups(self, tensors: list[torch.Tensor]) -> bool:
        """``local_sgd()``'s sync: ``tensors`` averaged in place over the groups in the quorum
        (formed at the period's first batch, or here), then the commit vote. False: a group
        failed in it, ``tensors`` hold nothing meaningful (the caller keeps its own values)."""
        return self._average_and_vote(tensors, "local_sgd()'s synchronisation", "every group "
                                      "keeps its own weights, and the next period goes on.")

    def _average_and_vote(self, tensors: list[torch.Tensor], what: str, outcome: str) -> bool:
        """The quorum (if none is open), the groups' check when it changed, ``tensors``
        averaged over the groups in it (one all-reduce per device and dtype), the vote."""
        self._quorum()
        if not self._member_ids <= self._checked_ids:
            self._check_same()
        reduce_in_buckets(tensors, lambda flat: self.manager.allreduce(flat).wait())
        return self._vote(what, outcome)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor itself under no_grad), else the tensor."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor
