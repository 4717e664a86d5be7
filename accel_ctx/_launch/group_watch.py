"""One replica group's launcher around torchrun's agent: what it says, when it restarts, and
whether its workers really joined the job.

torchrun's agent (``LocalElasticAgent``, in this process) checks its workers every
``--monitor-interval`` and restarts them all when one fails, up to ``--max-restarts``. For a
replica group, three things are added around that loop (:func:`watch`):

* the lighthouse is watched (a connection every second): a group whose lighthouse has not
  answered for the replica timeout stops its workers and ends naming it (:class:`LighthouseLost`),
  and a group whose workers failed while it is away is not restarted (each new worker would only
  wait the timeout for it, and fail again);
* a worker's failure is said once, in one line naming the group, the rank and its exit code or
  signal: torchrun's own ``failed (exitcode: -9) local_rank: ...`` line beside it is dropped;
* the workers get ``ACCEL_CTX_REPLICA_MARKS``, a fresh folder where each marks ``joined-<rank>``
  when its group's runtime opens (``distributed()`` or ``sharded()``). A group whose workers all
  ended 0 with no mark never met the other groups: :func:`never_joined` names that.

Examples:
    >>> import tempfile
    >>> from accel_ctx._launch.group_watch import never_joined
    >>> folder = tempfile.mkdtemp()
    >>> never_joined(folder, 1).split(":")[0]
    'replica group 1 trained on its own'
    >>> open(f"{folder}/joined-0", "w").close()
    >>> never_joined(folder, 1)
    ''
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from typing_extensions import override

from .._job import env as _env
from ..errors import AccelCtxError
from .settings import split_host_port

_TORCHRUN_FAILURE = "failed (exitcode: "  # multiprocessing/api.py's line per failed worker group
_PROBE_EVERY_S = 1.0


class LighthouseLost(AccelCtxError):
    """The replica groups' lighthouse stopped answering this group's launcher for the replica
    timeout: the group's workers were stopped, not restarted.

    Examples:
        >>> from accel_ctx._launch.group_watch import LighthouseLost
        >>> issubclass(LighthouseLost, Exception)
        True
    """


class _Beacon:
    """Whether the lighthouse accepts connections, asked every second in a thread of its own (the
    agent's loop never waits on the network): ``lost_since`` is when it stopped, None while up."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.lost_since: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="accel_ctx-lighthouse-watch",
                                        daemon=True)
        self._thread.start()

    def answers(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=2.0):
                return True
        except OSError:
            return False

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.answers():
                self.lost_since = None
            elif self.lost_since is None:
                self.lost_since = time.monotonic()
            self._stop.wait(_PROBE_EVERY_S)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)


class _DropTorchrunFailureLine(logging.Filter):
    """torchrun's ``failed (exitcode: -9) local_rank: 0 (pid: ...) of binary: ...``: the group's
    launcher says it itself, naming the group (:func:`watch`)."""

    @override
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_TORCHRUN_FAILURE)


def lost(address: str, group: int, seconds: float, multi_machine: bool) -> str:
    """The line of a group whose lighthouse is gone.

    Examples:
        >>> print(lost("http://node0:29510", 1, 30, True))  # doctest: +ELLIPSIS
        replica group 1 lost its lighthouse at http://node0:29510: it has not answered for 30 s ...
    """
    fix = ("start `accel-ctx lighthouse` there again (the same --port), then this group's "
           "launcher: it joins the live groups at their step" if multi_machine else
           "the `accel-ctx launch --replica-groups` that ran it is gone; start the job again")
    return (f"replica group {group} lost its lighthouse at {address}: it has not answered for "
            f"{seconds:g} s ({_env.REPLICA_TIMEOUT_VAR}), so the group's workers were stopped, "
            f"not restarted (each would only wait for it). To go on, {fix}.")


@contextlib.contextmanager
def watch(address: str, group: int, describe: Callable[[Any, int, int], str],
          multi_machine: bool, seconds: float | None = None) -> Iterator[None]:
    """Around torchrun's ``run``: watch the lighthouse at ``address`` (``http://HOST:PORT``),
    say each failure of the group's workers in one line (``describe(failures, restarts left,
    max restarts)`` words it) and refuse a restart while the lighthouse is away.

    Raises :class:`LighthouseLost` (from the agent's loop, which then stops the workers) once the
    lighthouse has not answered for ``seconds`` (default: the replica timeout)."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    timeout = _env.replica_timeout() if seconds is None else seconds
    host, port = split_host_port(address.removeprefix("http://")) or ("", 0)
    beacon = _Beacon(host, port) if host else None
    stock = LocalElasticAgent.__dict__["_monitor_workers"]

    def away_too_long(wait: bool) -> None:
        """Raise LighthouseLost when the lighthouse has been away ``timeout`` s; with ``wait``,
        wait for that moment while it is away (the workers are dead: nothing to watch)."""
        while beacon is not None and beacon.lost_since is not None:
            if time.monotonic() - beacon.lost_since >= timeout:
                raise LighthouseLost(lost(address, group, timeout, multi_machine))
            if not wait:
                return
            time.sleep(0.2)

    def monitor(agent: Any, worker_group: Any) -> Any:
        result = stock(agent, worker_group)
        if result.state == WorkerState.FAILED:
            left = agent._remaining_restarts
            if beacon is not None and left > 0 and not beacon.answers():  # asked now, not 1 s ago
                beacon.lost_since = beacon.lost_since or time.monotonic()
                away_too_long(wait=True)  # back in time: restarted as torchrun would
            print(describe(result.failures, left, worker_group.spec.max_restarts),
                  file=sys.stderr, flush=True)
        elif result.state == WorkerState.HEALTHY:
            away_too_long(wait=False)
        return result

    quiet = _DropTorchrunFailureLine()
    torchrun_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    torchrun_log.addFilter(quiet)
    LocalElasticAgent._monitor_workers = monitor  # type: ignore[method-assign]
    try:
        yield
    finally:
        LocalElasticAgent._monitor_workers = stock  # type: ignore[method-assign]
        torchrun_log.removeFilter(quiet)
        if beacon is not None:
            beacon.close()


def make_marks(environ: Mapping[str, str]) -> str:
    """A fresh folder for the workers' ``joined-<rank>`` marks (in the system's temporary
    folder); :func:`drop_marks` removes it."""
    return tempfile.mkdtemp(prefix="accel-ctx-replica-marks-",
                            dir=environ.get("TMPDIR") or None)


def drop_marks(folder: str) -> None:
    """Remove the marks' folder (what the workers wrote in it too)."""
    shutil.rmtree(folder, ignore_errors=True)


def never_joined(folder: str, group: int) -> str:
    """Why a group whose workers all ended 0 did not train with the others, or '' when one of
    its workers opened the group's runtime (it marked ``joined-<rank>`` in ``folder``)."""
    try:
        marks = [name for name in os.listdir(folder) if name.startswith("joined-")]
    except OSError:
        return ""  # the folder is gone (removed by hand): nothing is certain
    if marks:
        return ""
    return (f"replica group {group} trained on its own: the script never opened distributed() "
            "(or sharded()), so its workers never met the other replica groups, and each group "
            "trained a model of its own. Wrap the training loop in `with distributed():` (the "
            "model, optimizer and loader built inside it).")


def run_group(run: Callable[[int], int], verdict: Callable[[Any], tuple[int, Any, Any, int]],
              multi_machine: bool) -> int:
    """One replica group's launcher: ``run(group)`` (torchrun's, in this process) inside
    :func:`watch`, its workers told where to mark that they joined; 1 with one line when the
    lighthouse is lost, or when they all ended 0 and none joined (no ``distributed()``).
    ``verdict`` (the CLI's) names the rank that caused a failure, as :func:`failure_line` says."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    group = int(os.environ.get(_env.REPLICA_GROUP_VAR) or 0)
    marks = make_marks(os.environ)
    os.environ[_env.REPLICA_MARKS_VAR] = marks

    def describe(failures: Any, left: int, most: int) -> str:
        return failure_line(verdict(ChildFailedError("worker", dict(failures))), group, left,
                            most)

    try:
        with watch(os.environ[_env.LIGHTHOUSE_VAR], group, describe, multi_machine):
            code = run(group)
        alone = never_joined(marks, group) if code == 0 else ""
    except LighthouseLost as exc:
        print(f"accel-ctx launch: {exc}", file=sys.stderr)
        return 1
    finally:
        drop_marks(marks)
    if alone:
        print(f"accel-ctx launch: {alone}", file=sys.stderr)
        return 1
    return code


def failure_line(verdict: tuple[int, Any, Any, int], group: int, left: int,
                 max_restarts: int) -> str:
    """One line for a failure of replica ``group``'s workers, in place of torchrun's own:
    ``verdict`` (the rank that caused it, its failure, (the rank that named it, its message) or
    None, the exit code), and what the group does next (``left`` of ``max_restarts`` restarts).

    Examples:
        >>> from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
        >>> from accel_ctx._launch.group_watch import failure_line
        >>> killed = ProcessFailure(local_rank=0, pid=7, exitcode=-9, error_file="")
        >>> print(failure_line((0, killed, None, 137), 1, 3, 3))  # doctest: +NORMALIZE_WHITESPACE
        accel-ctx launch: rank 0 of replica group 1 (local rank 0, pid 7) was killed by signal
        SIGKILL; the group restarts its workers (restart 1 of 3), which heal from a live group.
    """
    rank, failure, namer, _ = verdict
    who = f"rank {rank} of replica group {group}"
    if namer is not None:
        by = f" (named by rank {namer[0]})" if namer[0] != rank else ""
        what = f"{who} caused the failure{by}: {namer[1]}"
    elif failure.exitcode < 0:
        what = (f"{who} (local rank {failure.local_rank}, pid {failure.pid}) was killed by "
                f"signal {failure.signal_name()}")
    else:
        what = (f"{who} (local rank {failure.local_rank}, pid {failure.pid}) exited with code "
                f"{failure.exitcode} (its output is above)")
    if left > 0:
        then = (f"the group restarts its workers (restart {max_restarts - left + 1} of "
                f"{max_restarts}), which heal from a live group")
    elif max_restarts:
        then = f"the group ends, its {max_restarts} restart(s) spent"
    else:
        then = ("the group ends (add --max-restarts K to restart its workers, which then heal "
                "from a live group)")
    return f"accel-ctx launch: {what}; {then}."
