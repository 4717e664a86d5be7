"""Sync points: ``wait_for_everyone()`` and ``main_process_first()``.

Both wait through ``_group.debug.barrier``, which knows about failures (a rank that failed in
rank-only code, left ``distributed()`` or died is named at once, not at the timeout).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .._group import blame as _blame
from .._group import debug as _debug
from .._kernel import state as _state
from .._options import checked, flag
from .process import announce, position


@checked
def wait_for_everyone() -> None:
    """Wait until every process of the job reaches this call; at once in a single process.

    Unlike ``dist.barrier()`` it knows about failures: when a rank failed in rank-only code
    (``@on_main_process`` & co., ``main_process_first()``), every rank raises
    :class:`~accel_ctx.errors.DistributedError` here naming that rank, instead of waiting for it
    until the timeout; a rank that left ``distributed()`` is named at once too. A rank that
    never arrives is named after ``distributed(timeout=...)``, with where it last was. Called
    inside rank-only code (``@on_main_process`` & co.) it raises at once: the other ranks would
    never arrive.

    Examples:
        >>> from accel_ctx import distributed, wait_for_everyone
        >>> with distributed():
        ...     wait_for_everyone()
    """
    job, _, world, _, _ = position()
    if job is not None and world > 1:
        _blame.refuse_rank_only("wait_for_everyone()", "it")
        _debug.barrier(job, "wait_for_everyone()")
        job.root.waits += 1  # per-rank results written to files may now be read together


@contextlib.contextmanager
@checked
def main_process_first(*, local: bool = False) -> Iterator[None]:
    """Run the block on the main process first, then on the others (downloads, preprocessing).

    The other ranks wait at the start of the block until the main process has left it, so they
    find its results (a downloaded file, a filled cache). ``local=True``: the first process of
    each machine goes first instead. If the main process fails inside the block, the waiting
    ranks raise :class:`~accel_ctx.errors.DistributedError` naming it instead of waiting (a
    failure on another rank is announced too, to their next ``wait_for_everyone()``). Also
    usable as a decorator: ``@main_process_first()``.

    Examples:
        >>> from accel_ctx import distributed, main_process_first
        >>> with distributed(), main_process_first():
        ...     data = list(range(3))  # e.g. download and cache the data set
        >>> data
        [0, 1, 2]
    """
    flag("main_process_first", "local", local)
    job, rank, world, local_rank, _ = position()
    if job is None or world == 1:
        yield
        return
    label = f"main_process_first({'local=True' if local else ''})"
    first = (local_rank if local else rank) == 0
    _blame.refuse_rank_only(label, "its two waits")
    if not first:
        _debug.barrier(job, label)
    mark = None
    if first:  # the others wait at the start of the block: a collective inside would hang
        mark = _state.enter_rank_only(_state.RankOnly(label, (
            "the first process of each machine runs the block" if local else "rank 0 runs the block"
        ) + " while the other ranks wait for it to finish"))
    try:
        yield
    except BaseException as exc:
        announce(f"inside {label}" + (", which the other ranks wait for" if first else ""), exc)
        raise
    finally:
        if mark is not None:
            _state.leave_rank_only(mark)
    if first:
        _debug.barrier(job, label)
