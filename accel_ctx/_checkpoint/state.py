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
from torch.utils.data import DataLoader

from .._data import records as _loader_records
from .._data.position import apply_position, pick
from .._kernel import state as _state
from .._kernel.session import Session


# ---- entries carried over -----------------------------------------------------------------------
class Carried:
    """An entry of the checkpoint a run resumed from whose object the run has not met again
    (a model called only for evaluation, an optimizer stepped every few steps): saved again as
    it was, so a second restart still finds it. ``state``: its DCP entry (None: an optimizer
    kept "plain"); ``form``: an optimizer's owner models (None: plain), ``...`` for others;
    ``plain``: a plain optimizer's ``state_dict()``; ``params``: an optimizer's parameter names;
    ``counters``: its optimizer or scheduler counters."""

    def __init__(self, state: Any, form: Any, plain: Any, params: Any,
                 counters: dict[str, Any]) -> None:
        self.state, self.form, self.plain, self.params = state, form, plain, params
        self.counters = counters

    @property
    def optimizer(self) -> bool:
        return self.form is not ...

    def state_dict(self) -> Any:
        return self.plain if self.optimizer and self.form is None else self.state

    def load_state_dict(self, state: Any) -> None:  # pragma: no cover - saved, never loaded
        raise NotImplementedError


# ---- counters ------------------------------------------------------------------------------------
def capture_counters(stack: _state.Stack | None, named: dict[str, Any]) -> dict[str, Any]:
    """Session, accumulation and fp16 state of the open scopes, plus named objects' records."""
    if stack is None:
        return {}
    session = stack.session
    session.read_skips()
    out: dict[str, Any] = {
        "session": (session.step, session.skipped_steps, session.backward_calls,
                    session.last_counted_group),
        "optimizers": {n: (r.calls, r.real, r.last_group) for n, o in named.items()
                       if isinstance(o, torch.optim.Optimizer)
                       and (r := session.optimizers.get(o)) is not None},
        "schedulers": {n: session.schedulers[o] for n, o in named.items()
                       if _weak(o) and o in session.schedulers},
    }
    for name, obj in named.items():
        if isinstance(obj, Carried):
            for kind, value in obj.counters.items():
                out[kind][name] = value
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
    session.forget_unread()
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


# ---- DataLoader positions (the rule itself is in accel_ctx._data.position) ------------------------------------------------------------------------
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


def still_pending(stack: _state.Stack | None) -> list[tuple[dict[str, Any], Any]]:
    """Positions a resumed session has not applied yet: a checkpoint saved before those loaders
    were iterated again keeps them as they were, not as if the run had started afresh."""
    if stack is None:
        return []
    return [entry for hook in stack.session.loader_hooks if isinstance(hook, PendingLoaders)
            for entry in hook.waiting()]


class PendingLoaders:
    """Positions of loaders saved unnamed: applied to the loaders iterated first here, each to
    the one it describes (the order deciding among equal ones; positions saved without a
    description: by order alone)."""

    def __init__(self, session: Session, entries: list[tuple[dict[str, Any], Any]],
                 named: list[DataLoader[Any]]) -> None:
        self._session = session
        self._entries = entries
        self._named = weakref.WeakSet(named)

    def waiting(self) -> list[tuple[dict[str, Any], Any]]:
        """The positions not applied yet (loaders this session has not iterated)."""
        return list(self._entries)

    def install(self) -> None:
        hooks = self._session.loader_hooks
        hooks[:] = [h for h in hooks if not isinstance(h, PendingLoaders)]  # the newest load wins
        if self._entries:
            hooks.append(self)

    def __call__(self, loader: Any, record: _loader_records.LoaderRecord) -> None:
        if loader in self._named or not isinstance(loader, DataLoader) or not self._entries:
            return
        # Among equal ones, a position in the middle of its epoch first: the loop's loader,
        # not a validation loader that finished its one pass at the start and is not met again.
        order = sorted(range(len(self._entries)), key=lambda i: self._entries[i][0]["finished"])
        index = pick([self._entries[i][0] for i in order], loader)
        if index is None:
            return  # not a loader of the checkpoint: its first epoch starts afresh
        entry, generator = self._entries.pop(order[index])
        apply_position(loader, record, entry, generator)
        if not self._entries:
            self._session.loader_hooks.remove(self)
