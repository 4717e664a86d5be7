"""torchft's side of a replica group: the module, the manager client that keeps each quorum
and refuses one this group must not train in, the replica ids, and the launcher's marks.

A group's torchft replica id is ``accel_ctx_n<size>_<group>`` (torchft adds ``:<uuid>`` for each
Manager): two members with one group index (two jobs at one lighthouse, one --replica-group used
twice) or groups of other sizes are refused inside torchft's quorum thread, before the quorum
configures a process group or heals anyone (:class:`RecordingClient`).
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import torch.distributed as dist
from torch import nn

from .._job.env import replica_marks
from .._job.job import Job
from .._job.orphan import end_with_parent
from ..errors import ConfigurationError, RendezvousError
from . import replica_events as _events
from . import replica_quiet as _quiet

# the launcher's hint (_launch.replica_groups, a wing this layer does not import): no PyPI release
FT_INSTALL = ("pip install 'torchft>=0.2' (the package of accel_ctx's ft extra: in the accel_ctx "
              "clone `pip install -e '.[ft]'`, or `pip install 'accel-ctx[ft]'` where accel_ctx "
              "is installed)")
_NO_TORCHFT = (
    "this process was started in a replica group (TORCHFT_LIGHTHOUSE is set: accel-ctx launch "
    "--replica-groups), which needs torchft: " + FT_INSTALL + ", or launch without "
    "--replica-groups.")


def torchft_module() -> Any:
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
    def loaders(self) -> list[Any]: ...
    def met(self, kind: str, obj: Any) -> None: ...
    def met_loader(self, loader: Any, record: Any) -> None: ...
    def hold(self, now: bool) -> None: ...
    def state(self, group: int) -> dict[str, Any]: ...
    def load(self, sent: dict[str, Any]) -> None: ...


CLASH_GRACE = 5.0  # seconds: more than the lighthouse's heartbeat timeout (2 s)
# seconds: a group back from a longer pause may have been left out (the lighthouse's join
# timeout is 1 s): its next quorum is formed before its batch, where it can heal
OVERLAP_WITHIN = 0.5


class Clash(Exception):
    """A quorum this group must not train in (raised in torchft's quorum thread, before the
    quorum configures a process group or heals anyone): two members with this group's index,
    or groups of other sizes. ``newcomer``: this group is the one that stops (the others wait
    for it to be gone); ``error``: what it says."""

    def __init__(self, newcomer: bool, error: str | None = None, told: str | None = None,
                 quiet: bool = False, odd: int = -1) -> None:
        super().__init__("a quorum this replica group must not train in")
        self.newcomer, self.error, self.told, self.quiet = newcomer, error, told, quiet
        self.odd = odd  # the group refused


class RecordingClient:
    """torchft's manager client, keeping the last quorum (which groups are in it), and refusing
    a quorum that holds another member with this group's index (another job at the same
    lighthouse, or a group started with the same --replica-group)."""

    def __init__(self, client: Any, own: str) -> None:
        self._client = client
        self.last: Any = None
        self.own = own  # this group's torchft replica id ("accel_ctx_n<size>_<group>:<uuid>")
        self.fresh = True  # no quorum yet: a clash at its first makes this group the newcomer
        self.tied: float | None = None  # since when groups of two sizes are as many

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        quorum = self._client._quorum(*args, **kwargs)
        group = group_of(self.own)
        same = sorted(r for r in quorum.replica_ids if group_of(r) == group)
        if len(same) > 1:
            # the one that joined last leaves; two that joined at once: all but the first id
            raise Clash(self.fresh and (quorum.heal or self.own != same[0]))
        # groups of other sizes meet in no collective (a rank without a peer waits for it):
        # the size the most groups have (the lowest group's among equals) stays
        sizes = {group_of(r): size_of(r) for r in quorum.replica_ids if size_of(r)}
        if len(set(sizes.values())) > 1:
            counts = Counter(sizes.values())
            best = max(counts.values())
            if list(counts.values()).count(best) > 1 and 0 not in sizes:
                # as many of each, group 0 not there yet: wait a little for it to tip the scale
                self.tied = self.tied or time.monotonic()
                if time.monotonic() - self.tied < 2 * CLASH_GRACE:
                    raise Clash(False, quiet=True)
            keep = next(sizes[g] for g in sorted(sizes) if counts[sizes[g]] == best)
            like = min(g for g in sizes if sizes[g] == keep)
            odd = min(g for g in sizes if sizes[g] != keep)
            error = _events.sizes(odd, sizes[odd], like, keep)
            raise Clash(sizes[group] != keep, error, error.split(":")[0], odd=odd)
        self.fresh = False
        self.last = quorum
        return quorum

    def should_commit(self, group_rank: int, step: int, should_commit: bool,
                      timeout: Any = None) -> bool:
        """The group's commit vote: its manager server answers the AND of its ranks' votes
        once each voted, and keeps nothing else (torchft's src/manager.rs). A group of one
        rank has its own vote as the answer, without the round trip (~1 ms a step)."""
        if size_of(self.own) == 1:
            return bool(should_commit)
        return bool(self._client.should_commit(group_rank, step, should_commit, timeout=timeout))

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


def size_of(replica_id: str) -> int:
    """The number of processes of the group whose replica id this is (0: not said)."""
    found = re.fullmatch(r"accel_ctx_n(\d+)_\d+", replica_id.split(":")[0])
    return int(found[1]) if found else 0


def group_of(replica_id: str) -> int:
    digits = replica_id.split(":")[0].rsplit("_", 1)[-1]
    return int(digits) if digits.isdigit() else -1


def open_manager(torchft: Any, job: Job, group: int, address: str, healing: Healing,
                 timeout: timedelta, unreachable: Callable[[BaseException], Exception]) -> Any:
    """This rank's torchft Manager of replica group ``group``, at the lighthouse ``address``;
    ``unreachable(exc)``: the error to raise where the lighthouse is not there."""
    # a worker whose group launcher is SIGKILLed ends (SIGTERM): its group was reported gone
    end_with_parent()
    pg = torchft.ProcessGroupGloo(timeout=timeout)

    def make() -> Any:
        transport = _quiet.quiet_transport(torchft, timeout)
        try:
            return torchft.Manager(
                pg=pg, checkpoint_transport=transport, load_state_dict=healing.load,
                state_dict=lambda: healing.state(group),
                min_replica_size=1, use_async_quorum=False,  # heal before the batch
                timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
                rank=job.rank, world_size=job.world_size, lighthouse_addr=address,
                # the group's size in its id: every member of a quorum reads the others'
                replica_id=f"accel_ctx_n{job.world_size}_{group}")
        except Exception as exc:  # the lighthouse is not there
            transport.shutdown(wait=False)
            raise unreachable(exc) from exc

    if job.world_size > 1 and dist.is_initialized():
        # rank 0 publishes its manager's address in the group's store: the others read it only
        # after, never a stale one from before a restart
        manager = make() if job.rank == 0 else None
        dist.barrier()
        return manager if manager is not None else make()
    return make()


def start_quorum(manager: Any, clash_wait: float, refuse: Callable[[Clash], None],
                 unreachable: Callable[[BaseException], Exception],
                 clash_error: Callable[[], str]) -> None:
    """``manager.start_quorum()``, tried again while its quorum holds a clash (:class:`Clash`):
    the newcomer stops (a ConfigurationError) once the clash outlasts the heartbeat, the group
    that stays calls ``refuse`` once and waits up to ``clash_wait`` seconds for it to be gone."""
    began, told = time.monotonic(), False
    manager._use_async_quorum = False  # heals before it returns, before the step's batch
    while True:
        try:
            manager.start_quorum()
            return
        except Clash as clash:
            manager._quorum_future = None  # failed: the next start must not wait on it
            waited = time.monotonic() - began
            # a member with this index that died asking for a quorum is gone once its
            # heartbeat lapses: only one that is still there after that is another group
            if clash.newcomer and clash.error is not None:
                raise ConfigurationError(clash.error) from None
            if waited > (CLASH_GRACE if clash.newcomer else clash_wait):
                raise ConfigurationError(clash_error()) from None
            if not clash.newcomer and not told and not clash.quiet:  # the newcomer stops
                refuse(clash)
                told = True
            time.sleep(0.5)
        except Exception as exc:
            raise unreachable(exc) from exc


def request_quorum(manager: Any, unreachable: Callable[[BaseException], Exception]) -> None:
    """Ask for the next quorum without waiting for it (torchft's asynchronous quorum): it forms
    in torchft's thread while this step's batch is fetched and its forward and backward run;
    :func:`settle_quorum` takes it before the first collective."""
    if manager._quorum_future is not None:
        manager._quorum_future.result()  # settled already: the flag below is read in its thread
    manager._use_async_quorum = True
    try:
        manager.start_quorum()
    except Exception as exc:
        manager._use_async_quorum = False
        raise unreachable(exc) from exc


def settle_quorum(manager: Any, client: RecordingClient, group: int,
                  unreachable: Callable[[BaseException], Exception]) -> bool:
    """Wait for the quorum :func:`request_quorum` asked for. False: it held a clash (the
    caller forms it again synchronously, where the clash is refused or waited for)."""
    try:
        manager.wait_quorum()
    except Clash:
        manager._quorum_future = None  # the next start must not wait on it
        return False
    except Exception as exc:
        raise unreachable(exc) from exc
    finally:
        manager._use_async_quorum = False
    if manager._healing:
        # left out while its step ran: that step's gradients are of older weights, and the
        # others cannot tell (they count it), so it restarts and heals before its first batch
        raise RendezvousError(_events.lapsed(group))
    # an asynchronous quorum counts only the groups at the newest step; none heals in this one
    # (a group that comes back heals before its first batch), so every member takes part, as
    # in a quorum formed synchronously, and every group divides the sum by the same count
    quorum = client.last
    manager._participating_replica_rank = quorum.replica_rank
    manager._participating_replica_world_size = quorum.replica_world_size
    return True
