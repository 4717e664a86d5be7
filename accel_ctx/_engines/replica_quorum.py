"""A replica group's quorums: asking torchft's Manager for each step's, taking it, and the
event lines for the groups that left, came back, were refused or finished.

:class:`GroupQuorum` is the part of ``fault_tolerant.ReplicaGroupRuntime`` that keeps the
membership; the runtime adds the step (the groups' check, the gradient average, the vote). A
step's quorum is asked for at its first batch or forward and forms beside the fetch, forward and
backward (torchft's asynchronous quorum); a group's first quorum, and the next after a pause,
form before the batch, where a healing group's DataLoader continues at its peers' position.
"""

from __future__ import annotations

import sys
import time
from contextlib import ExitStack

from .._job.job import Job
from .._kernel import state as _state
from .._kernel.concern import Concern
from ..errors import RendezvousError
from . import replica_check as _check
from . import replica_client as _ft
from . import replica_events as _events
from . import replica_quiet as _quiet
from .replica_client import Healing


class GroupQuorum(Concern):
    """The quorums of one replica group's rank, through its torchft Manager (``manager``)."""

    def __init__(self, job: Job, exits: ExitStack, healing: Healing) -> None:
        torchft = _ft.torchft_module()
        launch = job.launch
        self.group, self.groups = launch.replica_group, launch.replica_groups
        self.address = str(launch.lighthouse)
        self.healing = healing
        self._speaks = job.rank == 0  # one line per event and group
        self._world = job.world_size  # every group must have as many processes
        self._open = False  # a quorum was asked for the step under way
        self._asks = 0  # quorums asked for so far: a new one is a new step
        self._asked: tuple[frozenset[int], int, int] | None = None  # an overlapped one, unsettled
        self._settled = 0.0  # when the last quorum came (time.monotonic())
        self._members: frozenset[int] = frozenset()
        self._quorum_id = -1
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
        self._asks += 1
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

    @staticmethod
    def steps_locally(stack: _state.Stack | None) -> bool:
        """A ``local_sgd()`` entry is open: each step is the group's own (no quorum, average or
        vote); the groups meet only in :meth:`average_over_groups`."""
        return stack is not None and "local_sgd" in stack.slots

