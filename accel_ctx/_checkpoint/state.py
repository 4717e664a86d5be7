"""What accel_ctx itself owns in a checkpoint: counters, loss scale, accumulation, loader positions.

Everything here is plain data (ints, floats, tuples, tensors) so it loads with
``weights_only=True``. DataLoader positions are kept in *global* batches consumed in the epoch
(every rank's batches together), so a checkpoint taken on W ranks resumes on W' ranks: the
resumed epoch skips those batches, without loading them, and continues with the same order.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from .. import _data, _state
from .._session import Session


# ---- counters ------------------------------------------------------------------------------------
def capture_counters(stack: _state.Stack | None, named: dict[str, Any]) -> dict[str, Any]:
    """Session, accumulation and fp16 state of the open scopes, plus named objects' records."""
    if stack is None:
        return {}
    session = stack.session
    out: dict[str, Any] = {
        "session": (session.step, session.skipped_steps, session.backward_calls,
                    session.last_counted_group),
        "optimizers": {n: (r.calls, r.real, r.last_group) for n, o in named.items()
                       if isinstance(o, torch.optim.Optimizer)
                       and (r := session.optimizers.get(o)) is not None},
        "schedulers": {n: session.schedulers[o] for n, o in named.items()
                       if _weak(o) and o in session.schedulers},
    }
    # each open concern's own state (accumulation counters, the fp16 loss scale, ...)
    out["concerns"] = {c.slot: state for c in stack.concerns if (state := c.state_dict())}
    return out


def _weak(obj: Any) -> bool:
    try:
        weakref.ref(obj)
    except TypeError:
        return False
    return True


def apply_counters(stack: _state.Stack | None, saved: dict[str, Any], named: dict[str, Any]
                   ) -> None:
    if stack is None or not saved:
        return
    session = stack.session
    (session.step, session.skipped_steps, session.backward_calls,
     session.last_counted_group) = saved["session"]
    for name, (calls, real, last_group) in saved["optimizers"].items():
        if isinstance(named.get(name), torch.optim.Optimizer):
            record = session.optimizer(named[name])
            record.calls, record.real, record.last_group = calls, real, last_group
    for name, seen in saved["schedulers"].items():
        if name in named and _weak(named[name]):
            session.schedulers[named[name]] = tuple(seen)
    concerns = saved.get("concerns", {})
    for concern in stack.concerns:
        if concern.slot in concerns:
            concern.load_state_dict(concerns[concern.slot])


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are shards (sharded(): FSDP2's DTensors)."""
    return any(hasattr(p, "device_mesh") for p in model.parameters())


def mid_group(saved: dict[str, Any]) -> tuple[int, int] | None:
    """(micro-batches done, group size) when saved inside an accumulation group, else None."""
    acc = saved.get("concerns", {}).get("accumulate")
    if acc is None or acc["micro"] == 0:
        return None
    return acc["micro"], acc["steps"]


# ---- DataLoader positions ------------------------------------------------------------------------
def loaders_to_save(
    stack: _state.Stack | None, named: dict[str, DataLoader[Any]]
) -> list[tuple[str | None, DataLoader[Any]]]:
    """Named loaders (kwargs order), then the others in the order this scope first iterated them."""
    out: list[tuple[str | None, DataLoader[Any]]] = list(named.items())
    if stack is not None:
        mine = {id(loader) for loader in named.values()}
        for ref in stack.session.loader_order:
            loader = ref()
            if isinstance(loader, DataLoader) and id(loader) not in mine:
                out.append((None, loader))
    return out


def yielded(loader: DataLoader[Any]) -> int:
    record = _state.peek_loader_record(loader)
    return record.yielded if record is not None else 0


def _global_batches(loader: DataLoader[Any]) -> int | None:
    """Batches in one epoch over all ranks (None: a stream without ``len``)."""
    iterable = isinstance(loader.dataset, IterableDataset)
    return _data._length(loader, None, _data.ShardPlan(), iterable)


def position(loader: DataLoader[Any], name: str | None, yields: list[int]) -> dict[str, Any]:
    """Where ``loader`` stands, from every rank's count of batches handed out this epoch."""
    record = _state.peek_loader_record(loader)
    if record is None or record.epoch == 0:
        return {"name": name, "epoch": 0, "consumed": 0, "finished": True, "start_rng": None}
    plan = record.epoch_plan or _data.ShardPlan()
    total = _global_batches(loader)
    consumed = plan.skip + sum(yields)
    end = plan.end(total) if total is not None else None  # drop_last: full rounds only
    if end is not None:
        consumed = min(consumed, end)  # even_batches pads the last round with repeats
    return {
        "name": name,
        "epoch": record.epoch,
        "consumed": consumed,
        "finished": end is not None and consumed >= end,
        "start_rng": record.epoch_start_rng,
    }


def generator_state(loader: DataLoader[Any]) -> torch.Tensor | None:
    return loader.generator.get_state() if loader.generator is not None else None


def next_epoch(entry: dict[str, Any]) -> int:
    """0-based index of the epoch to run next: the one in progress, or the one after."""
    return int(entry["epoch"]) if entry["finished"] else int(entry["epoch"]) - 1


def apply_position(
    loader: DataLoader[Any], record: _state.LoaderRecord, entry: dict[str, Any],
    generator: torch.Tensor | None,
) -> None:
    """Make the loader's next iteration continue where the checkpoint left its epoch."""
    if generator is not None and loader.generator is not None:
        loader.generator.set_state(generator)
    if entry["epoch"] == 0:
        return
    if entry["finished"]:
        record.epoch, record.resume_skip, record.resume_rng = entry["epoch"], 0, None
    else:  # the next iteration replays this epoch's start, then skips what was consumed
        record.epoch = entry["epoch"] - 1
        record.resume_skip, record.resume_rng = entry["consumed"], entry["start_rng"]


class PendingLoaders:
    """Positions of loaders saved by order: applied to the next loaders iterated first here."""

    def __init__(self, session: Session, entries: list[tuple[dict[str, Any], Any]],
                 named: list[DataLoader[Any]]) -> None:
        self._session = session
        self._entries = entries
        self._named = weakref.WeakSet(named)

    def install(self) -> None:
        hooks = self._session.loader_hooks
        hooks[:] = [h for h in hooks if not isinstance(h, PendingLoaders)]  # the newest load wins
        if self._entries:
            hooks.append(self)

    def __call__(self, loader: Any, record: _state.LoaderRecord) -> None:
        if loader in self._named or not isinstance(loader, DataLoader) or not self._entries:
            return
        entry, generator = self._entries.pop(0)
        apply_position(loader, record, entry, generator)
        if not self._entries:
            self._session.loader_hooks.remove(self)
