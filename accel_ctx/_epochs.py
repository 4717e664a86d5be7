"""``set_epoch``: samplers and datasets that define it are told each new epoch of their loader.

A user's ``DistributedSampler`` reshuffles only when told the epoch, and streaming datasets
reseed their shuffle buffers the same way; forgetting the call silently trains every epoch on
the same order. A scope therefore calls ``set_epoch(e)`` (0-based, counting the loader's epochs
started inside scopes, resumed epochs included) on the loader's sampler, batch sampler, the
batch sampler's sampler and the dataset, before the epoch draws its order.

A loop that calls ``set_epoch`` itself keeps control: an object whose ``epoch`` attribute is no
longer what accel_ctx told it last (or, before the first epoch, is not 0) was set by the user,
and is left alone from then on.
"""

from __future__ import annotations

from typing import Any

from ._state import LoaderRecord

_USER = -1  # told_epochs marker: the user drives this object's epochs


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
        if isinstance(current, int) and current != expected:
            record.told_epochs[key] = _USER  # the loop sets it: leave it alone
            continue
        obj.set_epoch(epoch)
        record.told_epochs[key] = epoch
