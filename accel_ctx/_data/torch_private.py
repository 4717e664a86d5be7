"""The places where accel_ctx reaches into a DataLoader's private parts, each behind one name.

Checked on torch 2.11, 2.13 and 2.14 (``torch/utils/data/dataloader.py``): a DataLoader's
iterator reads the indices it fetches through the loader's ``_index_sampler`` property (the batch
sampler, or the sampler when batching is off) when it is built, and keeps the iterator it took
from it in ``_sampler_iter``; ``_get_iterator`` builds that iterator (what ``__iter__`` returns
without persistent workers); with them, ``__iter__`` keeps it in ``_iterator`` and resets it for
the next epoch. A torch that renames any makes these fail loudly, not silently.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader

INDEX_SAMPLER = "_index_sampler"


def index_sampler_property(view_of: Callable[[Any], Any | None]) -> property:
    """``DataLoader._index_sampler`` that answers ``view_of(loader)`` when it is not None (the
    sharding view a scope hands the stock iterator while building it), else torch's own."""
    original: property = DataLoader.__dict__[INDEX_SAMPLER]
    stock = original.fget
    assert stock is not None

    def _index_sampler(loader: DataLoader[Any]) -> Any:
        view = view_of(loader)
        return view if view is not None else stock(loader)

    return property(_index_sampler, doc=original.__doc__)


def sampler_iterator(stock_iterator: Any) -> Any:
    """The index iterator a DataLoader iterator took from its index sampler, if it has one."""
    return getattr(stock_iterator, "_sampler_iter", None)


def stock_iterator(loader: DataLoader[Any]) -> Any:
    """The iterator torch builds for ``loader``, past any patch of ``DataLoader.__iter__``."""
    return loader._get_iterator()


def starts_workers(loader: DataLoader[Any]) -> bool:
    """``iter(loader)`` will start worker processes: it has workers and none it keeps alive
    from an earlier epoch (persistent workers are reset, not started again)."""
    if loader.num_workers <= 0:
        return False
    return not (loader.persistent_workers and loader.__dict__.get("_iterator") is not None)


def builds_like_torch(loader: DataLoader[Any]) -> bool:
    """``loader``'s class builds its iterators with torch's own code (no subclass override)."""
    for kind in type(loader).__mro__:
        if kind is DataLoader:
            return True
        if "__iter__" in kind.__dict__ or "_get_iterator" in kind.__dict__:
            return False
    return False
