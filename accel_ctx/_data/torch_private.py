"""The three places where accel_ctx reaches into a DataLoader's private parts, each behind one
name.

Checked on torch 2.11, 2.13 and 2.14 (``torch/utils/data/dataloader.py``): a DataLoader's
iterator reads the indices it fetches through the loader's ``_index_sampler`` property (the batch
sampler, or the sampler when batching is off) when it is built, and keeps the iterator it took
from it in ``_sampler_iter``; ``_get_iterator`` builds that iterator (what ``__iter__`` returns
without persistent workers). A torch that renames any makes these fail loudly, not silently.
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
