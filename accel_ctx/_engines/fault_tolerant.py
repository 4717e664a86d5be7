"""Fault-tolerant replica groups: torchft's Manager across the groups, DDP inside each.

``accel-ctx launch --replica-groups R`` starts R groups, each its own job (its own process
group and restarts), told the lighthouse's address. ``distributed()`` opens a
:class:`ReplicaGroupRuntime` beside its runtime: each step has a quorum of the live groups
(torchft's ``Manager.start_quorum``, which heals a group that comes back from a peer), the
gradients DDP averaged in the group are averaged over the quorum (``Manager.allreduce``), and
``opt.step()`` runs only when ``Manager.should_commit()`` says every group's part succeeded; a
step whose collective failed is not committed nor counted, and the survivors go on.

A step's quorum is asked for at its first batch or forward and forms beside the fetch, forward
and backward (torchft's asynchronous quorum). A group's first quorum, and the next after a pause,
form before the batch: a healing group's DataLoader continues at its peers' position. The first
waits up to ``ACCEL_CTX_REPLICA_TIMEOUT`` (30 s) for every group while none stepped past the
start (0, or the step a whole job's restart resumed from).

At each new quorum id (every member reads it alike) the groups compare their scripts, models,
sizes and data (``replica_check``) before any gradient is averaged. A group whose quorum id
jumped was left out meanwhile and says so; a group whose loop ends first says so as its scope
closes (one more quorum, its row marked finished), so that the others do not report a failure.
"""

from __future__ import annotations

import sys
import time
from contextlib import ExitStack
from typing import Any

import torch
from typing_extensions import override

from .._job.job import Job
from .._kernel import state as _state
from .._kernel.concern import Concern, ForwardCall
from .._kernel.order import ORDER
from .._kernel.session import OptimizerRecord, Session
from ..errors import ConfigurationError, RendezvousError
from . import replica_check as _check
from . import replica_client as _ft
from . import replica_events as _events
from . import replica_quiet as _quiet
from .buckets import local_shard, reduce_in_buckets
from .replica_client import Healing, mark_joined


class ReplicaGroupRuntime(Concern):
    """One replica group's side of the job: its Manager, and the hooks that step through it."""

    slot, order = "replica_groups", ORDER["replica_groups"]

    def __init__(self, job: Job, exits: ExitStack, healing: Healing) -> None:
        torchft = _ft.torchft_module()
        launch = job.launch
        self.group, self.groups = launch.replica_group, launch.replica_groups
        self.address = str(launch.lighthouse)
        self.healing = healing
        self._speaks = job.rank == 0  # one line per event and group
        self._world = job.world_size  # every group must have as many processes
        self._open = False  # a quorum was asked for the step under way
        self._asked: tuple[frozenset[int], int, int] | None = None  # an overlapped one, unsettled
        self._settled = 0.0  # when the last quorum came (time.monotonic())
        self._decided: tuple[int, bool] | None = None  # (backward count, commit) of this step
        self._members: frozenset[int] = frozenset()
        self._quorum_id = self._checked_quorum = -1  # checked at each new quorum id (docstring)
        self._failure: str | None = None  # why the last step was not committed
        self._finished: set[int] = set()  # groups that said they finished (they did not fail)
        self._refused: set[int] = set()  # groups refused at a quorum (not waited for)
        self._left_at: dict[int, int] = {}  # the step each absent group left at
        self._local = False  # local_sgd() met the groups: they meet only at its syncs
        self._gathering = False  # the first quorum waits for every group
        self.participants = 1  # this group alone until a quorum says otherwise
        self._timeout = timeout = _events.timeout()
        _quiet.quiet_torchft(exits)
        self.manager = _ft.open_manager(torchft, job, self.group, self.address, healing, timeout,
                                        self._unreachable)
        own = self.manager._store.get("replica_id").decode()  # torchft's REPLICA_ID_KEY
        self._client = _ft.RecordingClient(self.manager._client, own)
        self.manager._client = self._client
        exits.callback(self.manager.shutdown, wait=False)
        exits.push(self._leave)  # before the shutdown: the others hear that it finished
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
        if not first and not self._local and not self.steps_locally(stack) and (
                began - self._settled < _ft.OVERLAP_WITHIN):
            # formed beside the step (none heals in it: the module docstring); a peer that
            # heals from this group meanwhile gets the step's start
            self.healing.hold(True)
            self._asked = (self._members, self._quorum_id, self._step())
            _ft.request_quorum(self.manager, self._unreachable)
            return
        if first and stack is not None and stack.session.step > self.manager.current_step():
            # resumable() restored the job from its folder: every group goes on from that step
            step = stack.session.step
            self.manager.load_state_dict({"step": step, "batches_committed": step * self.groups})
        before = int(self.manager.current_step())
        self._start()  # may heal this group from a peer (use_async_quorum off)
        if first:
            self._gathering = True  # the groups arriving at the start: no line for each
            while (len(self._members | self._refused) < self.groups
                   and self.manager.current_step() == before  # none stepped on: wait
                   and time.monotonic() - began < self._timeout.total_seconds()):
                time.sleep(0.2)  # the others are still starting: a step with all of them
                self._start()
            self._gathering = False
            missing = sorted(set(range(self.groups)) - self._members - self._refused)
            if missing and self.manager.current_step() == before:
                self._say(_events.missing(missing, len(self._members), self.address))
        step = int(self.manager.current_step())
        if step > before and self.healing.source >= 0:
            self._say(_events.healed(self.group, self.healing.source, self._step(),
                                     time.monotonic() - began))
            self.healing.source = -1

    def _settle(self) -> None:
        """Take the quorum asked for beside the step (a clash: formed again, in the open)."""
        if self._asked is None:
            return
        asked, self._asked = self._asked, None
        if _ft.settle_quorum(self.manager, self._client, self.group, self._unreachable):
            self._took(*asked)
        else:
            self._start()

    def _start(self) -> None:
        asked = self._members, self._quorum_id, self._step()
        self.healing.hold(False)
        _ft.start_quorum(self.manager, self._timeout.total_seconds(), self._refuse,
                         self._unreachable, lambda: _events.clash(self.group, self.address))
        self._took(*asked)

    def _took(self, previous: frozenset[int], last_id: int, last_step: int) -> None:
        """What a quorum brings: its members, and the lines for the groups that left or came."""
        self._settled = time.monotonic()
        quorum = self._client.last
        self._members = frozenset(_ft.group_of(r) for r in quorum.replica_ids) if quorum else (
            frozenset({self.group}))
        self._quorum_id = int(quorum.quorum_id) if quorum else -1
        self.participants = len(self._members)  # the groups in the step under way
        if not previous or self._gathering:
            return
        step = self._step()
        if last_id >= 0 and self._quorum_id > last_id + 1:
            # quorums formed without this group (every member of one reads its id): it was
            # dropped, frozen or too slow, and is back; what the others did meanwhile it did not
            # see, and they say it (the departures and returns it missed are not its to tell)
            self._say(_events.dropped(self.group, last_step, step, len(self._members)))
            self._failure = None
            return
        for line in _events.changes(self.group, previous, self._members, step, self._failure,
                                    self._left_at, self._finished,
                                    _check.samples_per_step(self.healing.loaders(), self._world)):
            self._say(line)
        self._failure = None

    def _refuse(self, clash: _ft.Clash) -> None:
        """The group that stays says once which group its quorum refused."""
        self._say(_events.refused(clash.told) if clash.told is not None
                  else _events.clashed(self.group, self._step()))
        self._refused.add(clash.odd)

    def _step(self) -> int:
        """The job's committed step: the session's under local_sgd() (torchft's counts syncs)."""
        stack = _state.current()
        if self.steps_locally(stack) and stack is not None:
            return stack.session.step
        return int(self.manager.current_step())

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
            grads = [local_shard(p.grad) for m in self.healing.models() for p in m.parameters()
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
    @staticmethod
    def steps_locally(stack: _state.Stack | None) -> bool:
        """A ``local_sgd()`` entry is open: each step is the group's own (no quorum, average or
        vote); the groups meet only in :meth:`average_over_groups`."""
        return stack is not None and "local_sgd" in stack.slots

    @override
    def average_over_groups(self, tensors: list[torch.Tensor]) -> bool:
        """``local_sgd()``'s sync: ``tensors`` averaged in place over the groups in the quorum
        (formed at the period's first batch, or here), then the commit vote. False: a group
        failed in it, ``tensors`` hold nothing meaningful (the caller keeps its own values)."""
        self._local = True
        return self._average_and_vote(tensors, "local_sgd()'s synchronisation", "every group "
                                      "keeps its own weights, and the next period goes on.")

    def _average_and_vote(self, tensors: list[torch.Tensor], what: str, outcome: str) -> bool:
        """The quorum (if none is open), the groups' check when it changed, ``tensors``
        averaged over the groups in it (one all-reduce per device and dtype), the vote."""
        self._quorum()
        self._settle()
        if self._quorum_id != self._checked_quorum or self._quorum_id < 0:
            self._check_same()
        reduce_in_buckets(tensors, lambda flat: self.manager.allreduce(flat).wait())
        return self._vote(what, outcome)

