"""``set_epoch``: samplers and datasets that define it are told each new epoch of their loader.

A user's ``DistributedSampler`` reshuffles only when told the epoch, and streaming datasets
reseed their shuffle buffers the same way; forgetting the call silently trains every epoch on
the same order. A scope therefore calls ``set_epoch(e)`` (0-based, counting the loader's epochs
started inside scopes, resumed epochs included) on the loader's sampler, batch sampler, the
batch sampler's sampler and the dataset, before the epoch draws its order.

A loop that calls ``set_epoch`` itself keeps control, and its sampler sees exactly the epochs
the loop gives it, however many iterators it makes and abandons (the DDP tutorial peeks at a
batch with ``next(iter(loader))`` before its ``set_epoch(epoch)``). A call accel_ctx did not make
is seen by the scoped patch of ``set_epoch`` on samplers and datasets (``_hooks.patches``), which marks
the object as driven by the loop; an object whose ``epoch`` attribute is no longer what accel_ctx
told it last (or, before the first epoch, is not 0) counts as driven too (a call made before any
scope opened). Either way accel_ctx leaves it alone from then on.
"""

from __future__ import annotations

import weakref
from contextvars import ContextVar
from typing import Any

from .records import LoaderRecord

_USER = -1  # told_epochs marker: the user drives this object's epochs
# set while accel_ctx itself calls set_epoch: such calls do not mark the object
_TELLING: ContextVar[bool] = ContextVar("accel_ctx_telling_epoch", default=False)
# objects whose set_epoch the loop called itself (weakly: a sampler may be dropped any time)
_driven: weakref.WeakSet[Any] = weakref.WeakSet()
_driven_ids: set[int] = set()  # the same for objects that take no weak reference


def note_call(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The gate of the scoped ``set_epoch`` patch: a call accel_ctx did not make marks the object."""
    if instance is not None and not _TELLING.get():
        try:
            _driven.add(instance)
        except TypeError:
            _driven_ids.add(id(instance))
    return wrapped(*args, **kwargs)


def _driven_by_loop(obj: Any) -> bool:
    try:
        return obj in _driven
    except TypeError:
        return id(obj) in _driven_ids


def _targets(loader: Any) -> list[Any]:
    batch_sampler = getattr(loader, "batch_sampler", None)
    candidates = [getattr(loader, "sampler", None), batch_sampler,
                  getattr(batch_sampler, "sampler", None), getattr(loader, "dataset", None)]
    seen: set[int] = set()
    out = []
    for obj in candidates:
        if obj is not None and id(obj) not in seen and callable(getattr(obj, "set_epoch", None)):
            seen.add(id(obj))
            out.append(obj)
    return out


def tell_epoch(loader: Any, record: LoaderRecord) -> None:
    """Before the epoch ``record.epoch`` (1-based, just counted) of ``loader`` draws its order."""
    epoch = record.epoch - 1
    for obj in _targets(loader):
        key = id(obj)
        told = record.told_epochs.get(key)
        if told == _USER:
            continue
        current = getattr(obj, "epoch", None)
        expected = 0 if told is None else told
        if _driven_by_loop(obj) or (isinstance(current, int) and current != expected):
            record.told_epochs[key] = _USER  # the loop sets it: leave it alone
            continue
        token = _TELLING.set(True)
        try:
            obj.set_epoch(epoch)
        finally:
            _TELLING.reset(token)
        record.told_epochs[key] = epoch
