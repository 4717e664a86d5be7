"""Where a DataLoader stands in its epoch: one rule for checkpoints and for users' own resumption.

A position is counted in *global* batches consumed in the epoch (every rank's batches
together), so a position taken on W ranks resumes on W' ranks: the resumed epoch replays its
start from the RNG states saved with it (same order, same worker seeds) and skips what was
consumed without loading it. ``save_state``/``load_state`` keep positions this way, and so do
:func:`loader_state` / :func:`load_loader_state` for users who manage their own checkpoints.
:func:`skip_first_batches` skips batches of the next epoch without replaying anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from .._kernel import state as _state
from .._options import checked
from .._ranks.collectives import gather_object, group_job
from ..errors import CheckpointError, ConfigurationError
from . import iterate as _data
from . import records as _records
from .shard import check_skip


def yielded(loader: DataLoader[Any]) -> int:
    """Batches of the current epoch this rank has handed out."""
    record = _records.peek_loader_record(loader)
    return record.yielded if record is not None else 0


def _global_batches(loader: DataLoader[Any]) -> int | None:
    """Batches in one epoch over all ranks (None: a stream without ``len``)."""
    iterable = isinstance(loader.dataset, IterableDataset)
    return _data._length(loader, None, _data.ShardPlan(), iterable)


def position(loader: DataLoader[Any], name: str | None, yields: list[int]) -> dict[str, Any]:
    """Where ``loader`` stands, from every rank's count of batches handed out this epoch."""
    record = _records.peek_loader_record(loader)
    if record is None or record.epoch == 0:
        return {"name": name, "epoch": 0, "consumed": 0, "finished": True, "start_rng": None,
                "what": describe(loader)}
    plan = record.epoch_plan or _data.ShardPlan()
    total = _global_batches(loader)
    if yields and plan.world > len(yields) and plan.world % len(yields) == 0:
        # replica groups: the plan spans every group, and each stands where this one does
        yields = yields * (plan.world // len(yields))
    tp = _state.coordinates().sharers  # the ranks of a tp or sp group share batches
    consumed = plan.skip + sum(yields[::tp] if tp > 1 and len(yields) % tp == 0 else yields)
    end = plan.end(total) if total is not None else None  # drop_last: full rounds only
    if end is not None:
        consumed = min(consumed, end)  # even_batches pads the last round with repeats
    return {
        "name": name,
        "epoch": record.epoch,
        "consumed": consumed,
        "finished": end is not None and consumed >= end,
        "start_rng": record.epoch_start_rng,
        "what": describe(loader),  # a loader met again is matched to its position by it
    }


def describe(loader: DataLoader[Any]) -> dict[str, Any]:
    """What a position's loader is: its samples, batches and order (plain data)."""
    try:
        samples: int | None = len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:
        samples = None  # a stream
    return {"samples": samples, "batch_size": loader.batch_size, "drop_last": loader.drop_last,
            "sampler": type(loader.sampler).__name__}


def pick(entries: list[dict[str, Any]], loader: DataLoader[Any]) -> int | None:
    """Which of the saved positions ``entries`` is ``loader``'s: the first of its description
    (the first of all for positions saved without one); None: none is (a loader new here)."""
    mine = describe(loader)
    for i, entry in enumerate(entries):
        if entry.get("what", mine) == mine:
            return i
    for entry in entries:
        was = entry["what"]
        if (was["samples"], was["sampler"]) == (mine["samples"], mine["sampler"]):
            raise CheckpointError(
                f"the checkpoint's position of a DataLoader over the same {mine['samples']} "
                f"samples ({mine['sampler']}) is of batch_size={was['batch_size']}, "
                f"drop_last={was['drop_last']}, and this loader has batch_size="
                f"{mine['batch_size']}, drop_last={mine['drop_last']}: its epoch would resume at "
                "the wrong batch, or skip samples. Keep batch_size and drop_last as they were to "
                "resume this run, or start the changed run in a new folder (or move the old "
                "checkpoints away).")
    return None


def generator_state(loader: DataLoader[Any]) -> torch.Tensor | None:
    return loader.generator.get_state() if loader.generator is not None else None


def next_epoch(entry: dict[str, Any]) -> int:
    """0-based index of the epoch to run next: the one in progress, or the one after."""
    return int(entry["epoch"]) if entry["finished"] else int(entry["epoch"]) - 1


def apply_position(
    loader: DataLoader[Any], record: _records.LoaderRecord, entry: dict[str, Any],
    generator: torch.Tensor | None,
) -> None:
    """Make the loader's next iteration continue where the checkpoint left its epoch."""
    record.last_pass = None  # a position asked for now: no earlier pass is taken over
    if generator is not None and loader.generator is not None:
        loader.generator.set_state(generator)
    if entry["epoch"] == 0:
        return
    if entry["finished"]:
        record.epoch, record.resume_skip, record.resume_rng = entry["epoch"], 0, None
    else:  # the next iteration replays this epoch's start, then skips what was consumed
        record.epoch = entry["epoch"] - 1
        record.resume_skip, record.resume_rng = entry["consumed"], entry["start_rng"]


# ---- public ----------------------------------------------------------------------------------
def _stateful(loader: Any) -> bool:
    """A loader that keeps its own position (torchdata's StatefulDataLoader and the like)."""
    return callable(getattr(loader, "state_dict", None)) and callable(
        getattr(loader, "load_state_dict", None))


def _check_loader(loader: Any, call: str) -> None:
    if not isinstance(loader, DataLoader) and not _stateful(loader):
        raise ConfigurationError(
            f"{call} takes a torch.utils.data.DataLoader (or a loader with state_dict() and "
            f"load_state_dict(), such as torchdata's StatefulDataLoader), got "
            f"{type(loader).__name__}."
        )


@checked
def loader_state(loader: Any) -> dict[str, Any]:
    """Where ``loader`` stands in its epoch, as plain data to keep in your own checkpoint.

    The position counts the batches every rank has consumed in the epoch, together with the
    random states the epoch drew its order from, so :func:`load_loader_state` resumes with
    exactly the batches a run that never stopped would see next, also on another number of
    processes. With several processes every rank must call it (it gathers the ranks' counts);
    every rank gets the same dict, so rank 0 may save it alone. A loader with its own
    ``state_dict()`` (torchdata's ``StatefulDataLoader``) is asked for that instead.

    Examples:
        >>> import torch
        >>> from torch.utils.data import DataLoader
        >>> from accel_ctx import distributed, load_loader_state, loader_state
        >>> loader = DataLoader(list(range(8)), batch_size=2)
        >>> with distributed():
        ...     it = iter(loader); first = next(it)
        ...     saved = loader_state(loader)
        >>> saved["consumed"]
        1
        >>> with distributed():
        ...     load_loader_state(loader, saved)
        ...     rest = [b.tolist() for b in loader]
        >>> rest == [[2, 3], [4, 5], [6, 7]]
        True
    """
    _check_loader(loader, "loader_state()")
    if _stateful(loader):
        return {"stateful": loader.state_dict()}
    count = yielded(loader)
    yields = gather_object(count) if group_job() is not None else [count]
    entry = position(loader, None, list(yields))
    del entry["name"], entry["what"]
    entry["generator"] = generator_state(loader)
    entry["batches"] = _global_batches(loader)  # the epoch's size: checked when loaded
    return entry


@checked
def load_loader_state(loader: Any, saved: Mapping[str, Any]) -> None:
    """Make ``loader``'s next iteration continue where :func:`loader_state` found it.

    The next ``for batch in loader`` (inside a scope) replays the saved epoch's start and
    skips what was consumed, on any number of processes; a finished epoch resumes at the next
    one. Call it before iterating. See :func:`loader_state` for an example.
    """
    _check_loader(loader, "load_loader_state()")
    if not isinstance(saved, Mapping):
        raise ConfigurationError(
            f"load_loader_state(loader, {_short(saved)}): give the dict loader_state() returned "
            f"for this loader, not a {type(saved).__name__}.")
    if ("stateful" in saved) != _stateful(loader):
        theirs = ("the own state of a loader with state_dict() (StatefulDataLoader)"
                  if "stateful" in saved else "the position of a plain DataLoader")
        mine = "keeps its own state" if _stateful(loader) else "has no state_dict()"
        raise ConfigurationError(
            f"load_loader_state(): the saved state is {theirs}, and this "
            f"{type(loader).__name__} {mine}; pass the state loader_state() gave for this loader.")
    if "stateful" in saved:
        loader.load_state_dict(saved["stateful"])
        return
    missing = {"epoch", "consumed", "finished", "start_rng"} - set(saved)
    if missing:
        raise ConfigurationError(
            f"load_loader_state(): the saved position lacks {sorted(missing)}; pass the dict "
            "loader_state() returned."
        )
    _check_fits(loader, saved)
    apply_position(loader, _records.loader_record(loader), dict(saved), saved.get("generator"))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_fits(loader: DataLoader[Any], saved: Mapping[str, Any]) -> None:
    """A position must be of an epoch like this loader's: another loader's (other data, batch
    size or drop_last) would skip the wrong batches, or all of them, without a word."""
    for key in ("epoch", "consumed"):
        value = saved[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigurationError(
                f"load_loader_state(): the saved {key}={value!r} is not a count >= 0; pass the "
                "dict loader_state() returned.")
    if not isinstance(saved["finished"], bool):
        raise ConfigurationError(
            f"load_loader_state(): the saved finished={saved['finished']!r} is not a bool; pass "
            "the dict loader_state() returned.")
    total = None if _data._already_sharded(loader) else _global_batches(loader)
    if total is None:
        return  # a stream without len(), or a loader whose length depends on the ranks
    size = saved.get("batches")
    if isinstance(size, int) and size != total:
        raise ConfigurationError(
            f"load_loader_state(): the saved position is of a loader with {size} batches per "
            f"epoch (all ranks together), and this loader has {total}. Pass the state "
            "loader_state() gave for this loader (same data, batch size and drop_last).")
    if saved["consumed"] > total:
        raise ConfigurationError(
            f"load_loader_state(): the saved position has {saved['consumed']} batches of its "
            f"epoch consumed, and this loader has {total} per epoch (all ranks together). Pass "
            "the state loader_state() gave for this loader (same data, batch size and "
            "drop_last).")


@checked
def skip_first_batches(loader: DataLoader[Any], batches: int) -> DataLoader[Any]:
    """Make the next epoch of ``loader`` start after its first ``batches`` batches (this rank's).

    For a loop that knows how far it got (``step`` from your own checkpoint): each rank skips
    ``batches`` of its own batches, without loading them, and the epoch goes on as it would
    have. The order is the one the epoch draws now: restore your random states first (or use
    :func:`loader_state`, which keeps them) for the exact batches of the interrupted run. It
    takes effect at the loader's next iteration inside a scope, once; the loader itself is
    returned, so ``for x in skip_first_batches(loader, n)`` reads naturally. After
    ``load_state`` (or :func:`load_loader_state`) restored the loader's position mid-epoch, the
    call is ignored with a warning: that position already skips the batches seen (a script moved
    from Accelerate that keeps both calls would otherwise skip them twice).

    Examples:
        >>> from torch.utils.data import DataLoader
        >>> from accel_ctx import distributed, skip_first_batches
        >>> loader = DataLoader(list(range(8)), batch_size=2)
        >>> with distributed():
        ...     rest = [b.tolist() for b in skip_first_batches(loader, 3)]
        >>> rest == [[6, 7]]
        True
    """
    if not isinstance(loader, DataLoader):
        raise ConfigurationError(
            f"skip_first_batches() takes a torch.utils.data.DataLoader, got "
            f"{type(loader).__name__}."
        )
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 0:
        raise ConfigurationError(
            f"skip_first_batches(loader, {batches!r}): give the number of batches to skip, an "
            "int >= 0."
        )
    stack = _state.current()
    record = _records.peek_loader_record(loader)
    if record is not None and _data.double_skip(record, batches):
        return loader  # the restored position skips them: skipping again would lose them
    pending = record.resume_skip if record is not None else 0
    iterable = isinstance(loader.dataset, IterableDataset)
    check_skip(batches, _data._total(loader, iterable), _data.plan_for(loader, stack, pending))
    record = _records.loader_record(loader)
    record.skip_batches = batches
    record.last_pass = None  # asked for now: no earlier pass is taken over
    return loader
