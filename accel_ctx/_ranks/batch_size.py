"""``find_executable_batch_size``: retry a function with half the batch size on out-of-memory.

The ranks decide together: after each attempt every rank says through the rendezvous store
(never a collective, which could pair with another call) whether it ran out of memory, and if
any did, every rank retries with the halved size. A rank that ran out while another went on
into a collective that waits for it (DDP's all-reduce in backward) cannot retry with it: it
fails at once, naming itself, and its leaving ends the other's wait at once too. Each rank
notes the size it tries in the store as an attempt begins, so that failure (and a timeout) names
every rank's batch size and where it is. The function must therefore be restartable: build the
model, optimizer and loader inside it.
"""

from __future__ import annotations

import functools
import gc
import itertools
import sys
import time
from collections.abc import Callable
from typing import Any, Concatenate, TypeVar, overload

from typing_extensions import ParamSpec

from .._engines import adopt as _adopt
from .._group.barrier import Watch, look_interval, store_and_prefix
from .._group.keywait import KeyWait
from .._job.progress import BACKWARD, FAILED, LEFT, describe, last_seen, process_gone
from .._job.progress import read as read_progress
from .._kernel import state as _state
from .._options import checked
from ..errors import AccelCtxError, ConfigurationError, DistributedError

P = ParamSpec("P")
R = TypeVar("R")

_OOM_TEXTS = (
    "out of memory",  # CUDA, XPU, MPS ("MPS backend out of memory")
    "can't allocate memory",  # DefaultCPUAllocator
    "not enough memory",  # DefaultCPUAllocator on some platforms, Windows
    "cudnn_status_not_supported",  # cuDNN's answer when its workspace does not fit
    "cublas_status_alloc_failed",
)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says an allocation failed (GPU or CPU)."""
    oom_type = getattr(sys.modules.get("torch"), "OutOfMemoryError", None)
    if isinstance(exc, MemoryError) or (oom_type is not None and isinstance(exc, oom_type)):
        return True
    if isinstance(exc, AccelCtxError):  # ours may quote another rank's out-of-memory
        return False
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(t in text for t in _OOM_TEXTS)


def _free_memory() -> None:
    gc.collect()
    torch: Any = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _adopted_now() -> set[int]:
    """The models the job has adopted so far (by identity)."""
    job = _state.current_job()
    return {id(m) for m in job.adoption.modules} if job is not None else set()


def _release_attempt(before: set[int]) -> None:
    """Forget the models a failed attempt adopted: their DDP engines refer to them, so they
    would stay in memory until the scope ends (a retry builds new ones); a model the caller
    still holds is simply adopted again at its next call, on every rank alike."""
    job = _state.current_job()
    if job is None:
        return
    for module in [m for m in job.adoption.modules if id(m) not in before]:
        _adopt.release(job, module)


_calls = itertools.count()  # every rank makes the same calls in the same order


def _announce_size(size: int, call: int, attempt: int) -> None:
    """Say through the store which batch size this rank tries now (once per attempt): a
    failure message names every rank's size, and a rank that runs out of memory names the
    size of one that went on without it."""
    job = _state.current_job()
    if job is None or job.world_size == 1:
        return
    store, prefix = store_and_prefix(job)
    store.set(f"{prefix}/batch_size/{call}/{attempt}/size/{job.rank}", str(size))


def _each_rank(job: Any, store: Any, base: str) -> str:
    """Every rank's batch size and state in this attempt: "rank 0 at batch size 8, step 0,
    in forward, inside torch.distributed's ...(); rank 1 at batch size 8, ran out of memory"
    (a rank that fails quotes it in its record, whose detail is cut at 1000 characters)."""
    try:
        return _read_each_rank(job, store, base)
    except RuntimeError:  # the store is gone (its host, rank 0, stopped): nothing to add
        return "unknown (the rendezvous store is gone)"


def _read_each_rank(job: Any, store: Any, base: str) -> str:
    world = job.world_size
    verdicts = {r: store.get(f"{base}/{r}").decode() for r in range(world)
                if store.check([f"{base}/{r}"])}
    sizes = {r: store.get(f"{base}/size/{r}").decode() for r in range(world)
             if store.check([f"{base}/size/{r}"])}
    records = read_progress(store, store_and_prefix(job)[1], world)
    parts = []
    for r in range(world):
        size = f"at batch size {sizes[r]}" if r in sizes else "not in this attempt yet"
        record = records.get(r)
        if verdicts.get(r) == "oom":
            state = "ran out of memory"
        elif verdicts.get(r) == "ok":
            state = "finished it, waiting for the others' outcomes"
        elif record is not None and record.get("state") in (LEFT, FAILED):
            state = f"{'left distributed()' if record['state'] == LEFT else 'failed'} at " \
                    f"{describe(record)}"
        elif record is not None and process_gone(record):
            state = f"its process died (last seen at {last_seen(record)})"
        elif record is not None:
            inside = f", inside torch.distributed's {record['blocked']}()" if record.get(
                "blocked") else ""
            state = f"{describe({**record, 'where': ''})}{inside}"  # short: it is quoted
        else:
            state = "nothing published yet"
        parts.append(f"rank {r} {size}, {state}")
    return "; ".join(parts)


def _anyone_ran_out(ran_out: bool, size: int, call: int, attempt: int, why: str) -> bool:
    """Every rank's verdict on this attempt; True if any rank ran out of memory.

    While it waits for the others' verdicts it looks about once a second for a rank that will
    never give one (see ``_group.barrier.Watch``): a rank whose process died, or one blocked in a
    collective (which waits for this rank) names that rank at once; a rank that ran out of
    memory while another went on into a collective names itself.
    """
    job = _state.current_job()
    if job is None or job.world_size == 1:
        return ran_out
    store, prefix = store_and_prefix(job)
    label = f"find_executable_batch_size() at batch size {size}"
    mine = job.progress.position()  # where this rank stopped: a rank past it waits for it
    job.progress.enter(label)
    base = f"{prefix}/batch_size/{call}/{attempt}"
    store.set(f"{base}/{job.rank}", "oom" if ran_out else "ok")
    if store.add(f"{base}/count", 1) == job.world_size:
        store.set(f"{base}/all", "1")
    keys = [f"{base}/{r}" for r in range(job.world_size)]
    watch = Watch(job, label)

    def look() -> None:
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        if ran_out:
            _refuse_if_waited_for(job, store, prefix, missing, size, why, mine, base)
        found = watch.never_arriving(missing)
        if found is not None:
            raise _naming(found[0], f"{label}: {found[1]}.")

    seconds = job.options.timeout.total_seconds()
    start = time.monotonic()
    try:
        if ran_out and not store.check([f"{base}/all"]):
            look()  # at once: a rank already waiting in a collective for this one
        KeyWait(store).wait(f"{base}/all", seconds, look, look_interval(job.world_size))
    except DistributedError:
        raise
    except RuntimeError as exc:
        if time.monotonic() - start < seconds:
            raise _naming(None, f"{label}: lost the rendezvous store ({exc}); the rank hosting "
                                "it (rank 0) has most likely stopped: see its output.") from exc
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        raise _naming(missing[0] if missing else None, (
            f"{label}: {', '.join(f'rank {r}' for r in missing)} did not finish the attempt "
            f"within distributed(timeout={seconds:g} s). Each rank: "
            f"{_each_rank(job, store, base)}.")
        ) from exc
    job.progress.phase = f"after {label}"
    return any(v == b"oom" for v in store.multi_get(keys))


def _naming(culprit: int | None, text: str) -> DistributedError:
    error = DistributedError(text)
    error.culprit = culprit  # type: ignore[attr-defined]
    return error


def _refuse_if_waited_for(job: Any, store: Any, prefix: str, missing: list[int], size: int,
                          why: str, mine: tuple[int, int], base: str) -> None:
    """A rank that went on, past where this one stopped, into a collective waits for this
    one, which cannot join it: the attempt cannot be retried together, so fail now (the
    others then fail fast, naming this rank) rather than at the collective's timeout. A
    record at this rank's own position is one this rank took part in (a heartbeat lags)."""
    records = read_progress(store, prefix, job.world_size)
    for rank in missing:
        record = records.get(rank, {})
        phase = str(record.get("phase", ""))
        waiting = phase == BACKWARD or bool(record.get("blocked")) or (
            phase.endswith("()") and not phase.startswith("after "))
        ahead = (int(record.get("step", 0)), int(record.get("seq", 0))) > mine
        if not (waiting and ahead):
            continue
        inside = f", inside torch.distributed's {record['blocked']}()" if record.get(
            "blocked") else ""
        raise _naming(job.rank, (
            f"rank {job.rank} ran out of memory at batch size {size} while rank {rank} went "
            f"on into {phase}{inside}, which waits for rank {job.rank}: the ranks cannot retry "
            f"together. Each rank: {_each_rank(job, store, base)}. Rank {job.rank}: {why}. "
            "Give find_executable_batch_size a starting_batch_size "
            "that fits on every rank, or even out the ranks' memory use (the same data sizes "
            "per rank)."))


@overload
def find_executable_batch_size(
    function: Callable[Concatenate[int, P], R], *, starting_batch_size: int = 128,
    min_batch_size: int = 1,
) -> Callable[P, R]: ...


@overload
def find_executable_batch_size(
    function: None = None, *, starting_batch_size: int = 128, min_batch_size: int = 1,
) -> Callable[[Callable[Concatenate[int, P], R]], Callable[P, R]]: ...


@checked
def find_executable_batch_size(
    function: Callable[Concatenate[int, P], R] | None = None, *, starting_batch_size: int = 128,
    min_batch_size: int = 1,
) -> Callable[P, R] | Callable[[Callable[Concatenate[int, P], R]], Callable[P, R]]:
    """Call the function with ``batch_size`` as its first argument, halving it on out-of-memory.

    The decorated function is called without its first argument: it gets
    ``starting_batch_size``, then half of it each time an attempt runs out of memory
    (``torch.OutOfMemoryError`` on a GPU, the CPU allocator's "can't allocate memory",
    ``MemoryError``), with garbage collected and the CUDA cache emptied in between. Other
    errors are raised at once. Under ``distributed()`` every rank takes part: after each
    attempt the ranks compare outcomes, and if any rank ran out of memory they all retry with
    the same halved size, so the sizes never differ. Build the model, optimizer and loader
    inside the function: a retry starts it again from the top. Below ``min_batch_size`` it
    raises :class:`~accel_ctx.errors.ConfigurationError` naming the sizes tried.

    An out-of-memory on one rank while another has gone on into a collective that waits for it
    (DDP's gradient all-reduce) cannot be retried together: that rank raises
    :class:`~accel_ctx.errors.DistributedError` at once, naming itself, and the others' wait
    ends with it, never at the collective's timeout.

    Examples:
        >>> from accel_ctx import find_executable_batch_size
        >>> @find_executable_batch_size(starting_batch_size=64)
        ... def train(batch_size):
        ...     if batch_size > 16:
        ...         raise MemoryError("pretend this did not fit")
        ...     return batch_size
        >>> train()
        16
    """
    if function is not None and not callable(function):
        raise ConfigurationError(
            f"find_executable_batch_size({function!r}): decorate the function that takes the "
            "batch size first; pass the sizes by name: "
            "@find_executable_batch_size(starting_batch_size=128).")
    for name, value in (("starting_batch_size", starting_batch_size),
                        ("min_batch_size", min_batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigurationError(
                f"find_executable_batch_size({name}={value!r}): give a whole number >= 1.")
    if min_batch_size > starting_batch_size:
        raise ConfigurationError(
            f"find_executable_batch_size(starting_batch_size={starting_batch_size}, "
            f"min_batch_size={min_batch_size}): the smallest size exceeds the first, so no size "
            "would ever be tried. Give min_batch_size <= starting_batch_size.")

    def decorate(fn: Callable[Concatenate[int, P], R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            size, call = starting_batch_size, next(_calls)
            tried: list[int] = []
            while True:
                adopted = _adopted_now()
                if size < min_batch_size:
                    raise ConfigurationError(
                        f"{getattr(fn, '__qualname__', fn)!s} ran out of memory at every batch "
                        f"size tried ({', '.join(map(str, tried))}); lower the model's memory "
                        "(mixed_precision, sharded(), gradient checkpointing) or "
                        "min_batch_size.")
                why = ""
                _announce_size(size, call, len(tried))
                try:
                    result = fn(size, *args, **kwargs)
                except Exception as exc:
                    if not is_out_of_memory(exc):
                        raise
                    exc.__traceback__ = None  # its frames hold the tensors to free
                    why = f"{type(exc).__name__}: {str(exc)[:200]}"
                if why:
                    _free_memory()
                if not _anyone_ran_out(bool(why), size, call, len(tried), why):
                    return result
                _release_attempt(adopted)  # on every rank alike: they all retry
                _free_memory()
                tried.append(size)
                size //= 2

        return run

    if function is not None:
        return decorate(function)
    return decorate
