"""Name the right rank when a collective fails.

A DDP all-reduce in backward, a broadcast in forward, one of our collectives or a barrier that
fails with gloo's/NCCL's "Timed out" or "Connection closed by peer" says nothing about who is to
blame, and the rank that raises is usually the healthy one. Here the failing rank reads every
rank's last progress (``_job.progress``) and re-raises a :class:`DistributedError` naming the rank
that stopped and where, chaining the original exception:

1. a rank that failed first (and whoever it blamed), or that left ``distributed()``;
2. a rank whose process is gone (same machine: checked by pid);
3. a rank behind the others (an earlier step, or earlier in the step): it stopped answering;
4. a rank whose heartbeat stopped (another machine, a frozen process).

The error records the culprit (``culprit``) for the launchers, and under torchrun the same in
the worker's error file, where ``accel-ctx launch`` reads it for its summary. This rank is then
marked failed, so the others name the same culprit and their store barriers stop at once.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch.distributed as dist
from typing_extensions import ParamSpec

from .._job import progress as _progress
from .._kernel import state as _state
from ..errors import AccelCtxError, DistributedError

if TYPE_CHECKING:
    from .._job.job import Job

P = ParamSpec("P")
R = TypeVar("R")
CULPRIT_KEY = "accel_ctx_culprit"
_MARKERS = ("gloo", "nccl", "connection closed", "connection reset", "timed out", "timeout",
            "broken pipe", "c10d", "by peer", "socket")


def looks_distributed(exc: BaseException) -> bool:
    """Whether ``exc`` is a communication failure (not ours, not a user's error in backward)."""
    if isinstance(exc, AccelCtxError):
        return False
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(m in text for m in _MARKERS)


def reraise(job: Job, exc: BaseException, doing: str) -> None:
    """Raise a DistributedError naming the culprit if ``exc`` is a communication failure;
    note any other exception in the rank's record (a script that catches it and goes on is
    then told apart from one that skipped a call)."""
    if job.world_size > 1 and looks_distributed(exc):
        raise failure(job, exc, doing) from exc
    if job.world_size > 1 and not isinstance(exc, AccelCtxError):
        progress = job.progress
        text = f"{type(exc).__name__}: {exc}".strip()
        progress.raised = f"{text[:200]}, at {progress.describe()}"


def raised_before(record: dict[str, Any]) -> str:
    """" (it had raised ValueError: bad batch, at step 3, in forward)", or ""."""
    raised = record.get("raised")
    return f" (it had raised {raised})" if raised else ""


def refuse_rank_only(call: str, what: str = "the collective") -> None:
    """Raise at once when ``call`` (a collective entry point) runs inside rank-only code."""
    mark = _state.rank_only()
    if mark is not None:
        raise DistributedError(
            f"{call} called inside {mark.label}: {mark.who}, so the other ranks never join "
            f"{what} and this rank would wait for them until the timeout. Move the call out of "
            f"it, so that every rank makes it (pass its result in as an argument if needed)."
        )


def collective(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorate a collective entry point: refuse rank-only code, record the phase, blame."""
    name = f"{fn.__name__}()"
    after = f"after {name}"

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        stack = _state.current()
        job = stack.job if stack is not None else None
        if job is None or job.world_size == 1:
            return fn(*args, **kwargs)
        refuse_rank_only(name)
        progress = job.progress
        progress.enter(name)
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:
            reraise(job, exc, name)
            raise
        progress.phase = after
        return result

    return run


# ------------------------------------------------------------------------------------------------
# the verdict
# ------------------------------------------------------------------------------------------------
def failure(job: Job, exc: BaseException, doing: str) -> DistributedError:
    """The error to raise instead of ``exc``; marks this rank failed, blaming the culprit."""
    me = job.rank
    timed_out = any(word in str(exc).lower() for word in ("timed out", "timeout"))
    job.progress.hold()  # another rank timing out now must not take this one for busy
    try:
        culprits, summary, advice = _judge(job, doing, timed_out)
    except Exception:  # the store is gone too: its host (rank 0 or the launcher) has exited
        culprits, summary, advice = [], (
            f"rank {me} lost its connection to the other ranks in {doing}, and the rendezvous "
            "store with it"), (
            "The rank hosting the store (rank 0 without a launcher) has most likely exited: "
            "see its output for the cause.")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    error = DistributedError(f"rank {me}: {summary}. {advice} (torch: {first[:300]})")
    error.culprit = culprits[0] if culprits else None  # type: ignore[attr-defined]
    progress = job.progress
    progress.state, progress.detail, progress.blames = _progress.FAILED, summary, culprits
    beat = job.root.heartbeat
    if beat is not None:
        beat.publish(dist.distributed_c10d._get_default_store())
    from .barrier import announce_failure

    announce_failure(job, summary, "blame", culprits[0] if culprits else None)
    if error.culprit is not None:  # type: ignore[attr-defined]
        write_error_file(error, error.culprit, exc)  # type: ignore[attr-defined]
    return error


def _judge(job: Job, doing: str, timed_out: bool
           ) -> tuple[list[int], str, str]:
    from .barrier import store_and_prefix

    store, prefix = store_and_prefix(job)
    me, world = job.rank, job.world_size
    records = _progress.read(store, prefix, world)
    found = _culprits(records, me, job.progress, doing, timed_out)
    if found is None:  # wait a few beats: a process frozen or gone on another machine
        beats = {r: rec.get("beat") for r, rec in records.items()}
        time.sleep(2.5 * _progress.INTERVAL_S)
        records = _progress.read(store, prefix, world)
        found = _culprits(records, me, job.progress, doing, timed_out)
        if found is None:
            frozen = [r for r, rec in records.items()
                      if r != me and rec.get("beat") == beats.get(r)]
            if frozen:
                where = "; ".join(f"rank {r} at {_progress.describe(records[r])}" for r in frozen)
                found = frozen, (
                    f"rank(s) {frozen} stopped answering (no sign of life for "
                    f"{2.5 * _progress.INTERVAL_S:g} s: {where}) while rank {me} was in {doing}"
                ), "Their process died or froze: see their output for the cause."
            elif timed_out:
                found = busy_elsewhere(records, me, doing)
    if found is not None:
        return found
    silent = [r for r in range(world) if r != me and r not in records]
    if silent:
        return silent, (
            f"rank(s) {silent} never reported any progress (dead or stuck since the scope "
            f"began) while rank {me} was in {doing}"
        ), "See their output for the cause."
    listing = "; ".join(
        f"rank {r}: {_progress.describe(rec)}" for r, rec in sorted(records.items()))
    return [], (
        f"rank {me} gave up in {doing}, and no rank is behind the others ({listing})"
    ), (
        "The ranks are most likely in different collectives: every rank must make the same "
        "sequence of collective calls (look for one under `if state().is_main_process:` or a "
        "loop that runs a different number of times on some ranks); distributed(debug=True) "
        "compares the calls and names the mismatch."
    )


_DYING_S = 2.0  # a killed process closes its sockets before /proc shows it gone


def busy_elsewhere(records: dict[int, dict[str, Any]], me: int, doing: str
                   ) -> tuple[list[int], str, str] | None:
    """Live ranks in no collective and no wait of ours while this one timed out waiting in
    one (a write that hangs, a loop on that rank alone): the ranks it waited for. A backward is left out: DDP waits for the others inside the autograd engine,
    where no frame shows it."""
    busy = sorted(r for r, rec in records.items()
                  if r != me and rec.get("state") == _progress.RUNNING and not rec.get("waiting")
                  and not rec.get("blocked") and rec.get("phase") != _progress.BACKWARD)
    if not busy:
        return None
    where = "; ".join(f"rank {r} at {_progress.describe(records[r])}" for r in busy)
    return busy, (
        f"rank(s) {busy} never came to the call: busy outside any collective ({where}) while "
        f"rank {me} timed out waiting in {doing}"
    ), (
        f"See what rank {busy[0]} does at that line (a read or write that hangs, work on that "
        "rank alone); if it is only slow, raise distributed(timeout=...)."
    )


def _gone(peers: dict[int, dict[str, Any]], wait: float) -> list[int]:
    """Ranks whose process has died; a lost connection waits up to ``wait`` seconds for it to
    show (the peer's sockets close while its process is still exiting)."""
    deadline = time.monotonic() + wait
    while True:
        gone = sorted(r for r, rec in peers.items() if _progress.process_gone(rec))
        if gone or time.monotonic() >= deadline:
            return gone
        time.sleep(0.05)


def _culprits(records: dict[int, dict[str, Any]], me: int, mine: _progress.Progress,
              doing: str, timed_out: bool) -> tuple[list[int], str, str] | None:
    peers = {r: rec for r, rec in records.items() if r != me}
    failed = {r: rec for r, rec in peers.items() if rec.get("state") == _progress.FAILED}
    for r, rec in sorted(failed.items()):
        blamed = [int(b) for b in rec.get("blames", []) if int(b) != r]
        if me in blamed:
            return [me], (
                f"rank {r} gave up waiting for this rank: {rec.get('detail', '')}"
            ), "This rank is the one named: see why it was late or stuck (above)."
        if blamed:
            return blamed, f"{rec.get('detail', '')} (reported by rank {r})", (
                f"See rank {blamed[0]}'s output for the cause.")
    if failed:
        r, rec = min(failed.items())
        return [r], (
            f"rank {r} failed at {_progress.describe(rec)} ({rec.get('detail', '')}) while "
            f"rank {me} was in {doing}"
        ), f"See rank {r}'s traceback for the cause."
    left = sorted(r for r, rec in peers.items() if rec.get("state") == _progress.LEFT)
    if left:
        return left, (
            f"rank {left[0]} left distributed() at {_progress.describe(peers[left[0]])}"
            f"{raised_before(peers[left[0]])} while rank {me} was in {doing}"
        ), (
            "Every rank must make the same collective calls until the scope ends: look for a "
            f"loop that ends sooner, a break or a return on rank {left[0]}."
        )
    gone = _gone(peers, 0.0 if timed_out else _DYING_S)
    if gone:
        return gone, (
            f"rank {gone[0]}'s process died (last seen at {_progress.last_seen(peers[gone[0]])}) "
            f"while rank {me} was in {doing}"
        ), (
            f"See rank {gone[0]}'s output: a crash in native code, os._exit() or running out of "
            "memory ends a process without a traceback."
        )
    position = mine.position()
    behind = [r for r, rec in peers.items()
              if (int(rec.get("step", 0)), int(rec.get("seq", 0))) < position]
    if behind:
        lowest = min(behind, key=lambda r: (int(peers[r].get("step", 0)),
                                            int(peers[r].get("seq", 0)), r))
        how = "timed out waiting for it" if timed_out else "lost the connection to it"
        return [lowest], (
            f"rank {lowest} stopped answering at {_progress.last_seen(peers[lowest])}; rank "
            f"{me} {how} in {doing}"
        ), (
            f"See what rank {lowest} is doing there; if it is only slow (an evaluation or a "
            "save on that rank alone), raise distributed(timeout=...)."
        )
    return None


# ------------------------------------------------------------------------------------------------
# the launchers
# ------------------------------------------------------------------------------------------------
def write_error_file(error: BaseException, culprit: int, cause: BaseException) -> None:
    """Under torchrun, leave the error with its culprit where ``accel-ctx launch`` reads it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": f"{type(error).__name__}: {error}", "extraInfo": {
        "py_callstack": "".join(traceback.format_exception(cause)),
        "timestamp": str(int(time.time())), CULPRIT_KEY: culprit}}}
    # Whole or not at all: torchrun's agent reads the file once the worker is gone, and a file
    # cut short (the worker killed while writing: the agent's SIGTERM after a peer died) makes
    # the agent itself fail on the JSON instead of restarting the job.
    partial = f"{path}.{os.getpid()}.partial"
    try:
        with open(partial, "w") as f:
            json.dump(data, f)
        os.replace(partial, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(partial)


def culprit_of(error_file_data: Any) -> tuple[int, str] | None:
    """The culprit rank and the message of a failed worker's error file, if accel_ctx wrote it."""
    with contextlib.suppress(Exception):
        message = error_file_data["message"]
        return int(message["extraInfo"][CULPRIT_KEY]), str(message["message"])
    return None
