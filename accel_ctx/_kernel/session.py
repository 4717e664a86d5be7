"""The session: counters shared by the nested scopes of one outermost scope entry in a thread.

Plain bookkeeping (optimizer steps, backward passes, the DataLoaders being iterated) that the
patches update and the concerns read. It knows no concern.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch


class OptimizerRecord:
    """Per-optimizer counters: calls of ``step()``, real steps, and re-entrancy depth."""

    __slots__ = ("__weakref__", "calls", "depth", "depth_mark", "last_group", "real", "skipping",
                 "unread")

    def __init__(self) -> None:
        self.calls = 0  # step() calls seen in a scope
        self.real = 0  # of those, steps that really updated the parameters
        self.depth = 0  # >1 while a subclass's step() calls super().step()
        self.depth_mark = -1  # backward count when the outer step() began
        self.last_group = -1  # accumulation group of the last allowed step
        self.skipping = False
        # Steps the device may have skipped (fused fp16 steps), counted in ``real`` until read.
        self.unread: torch.Tensor | None = None


class UnevenRound(Protocol):
    """The incomplete last round of an epoch under ``even_batches=False`` (see ``_engines.join``)."""

    def note_gather(self, obj: Any, batch: int, regather: Callable[[Any, Any, bool], Any]
                    ) -> None: ...


class LoaderIteration:
    """One epoch of one DataLoader being iterated in this thread."""

    __slots__ = ("at_end", "index", "is_last", "is_padding", "length", "loader", "uneven")

    def __init__(self, length: int | None, uneven: UnevenRound | None = None) -> None:
        self.length = length
        self.index = -1  # index of the batch handed out last
        self.is_last = False  # that batch ends the epoch's accumulation groups
        self.at_end = False  # that batch is this rank's last of the epoch
        self.is_padding = False  # that batch repeats earlier samples to even out the ranks
        self.loader: Any = None  # the DataLoader being iterated (the stock iterator drops it)
        self.uneven = uneven  # even_batches=False: the _join.UnevenTail of this epoch


LoaderHook = Callable[[Any, Any], None]
"""Called with (loader, its LoaderRecord) at a loader's first iteration in the session."""


class Session:
    """Counters of one outermost scope entry in one thread (steps, backward passes, loaders)."""

    def __init__(self) -> None:
        self.backward_calls = 0
        self.step = 0  # optimizer steps taken (skipped fp16 steps included)
        self.skipped_steps = 0  # known so far: see read_skips
        self.last_counted_group = -1  # backward count at the last counted step
        self.optimizers: weakref.WeakKeyDictionary[torch.optim.Optimizer, OptimizerRecord] = (
            weakref.WeakKeyDictionary()
        )
        self.schedulers: weakref.WeakKeyDictionary[Any, tuple[int, int]] = (
            weakref.WeakKeyDictionary()
        )
        # the optimizer looked up last and its record: a step looks it up three times (zero_grad,
        # before and after step), and a WeakKeyDictionary lookup makes a weak reference each time
        self._last_optimizer: tuple[weakref.ref[Any], OptimizerRecord] | None = None
        self.loaders: list[LoaderIteration] = []
        # DataLoaders in the order of their first iteration in this session, and what runs at
        # each first iteration (a checkpoint's positions for loaders it knows by that order).
        self.loader_order: list[weakref.ref[Any]] = []
        self.loader_hooks: list[LoaderHook] = []

    def skip_later(self, record: OptimizerRecord, flag: torch.Tensor) -> None:
        """A step the device skips if ``flag`` is nonzero; counted as real until read.

        The flags add up on the device (one small kernel per step), so knowing costs one host
        sync when a count is read, never one per step.
        """
        skipped = flag.reshape(()).gt(0)
        record.unread = skipped.long() if record.unread is None else record.unread + skipped

    def read_skips(self, record: OptimizerRecord | None = None) -> None:
        """Bring the device's skip flags into ``skipped_steps`` and ``real`` (waits for it)."""
        for each in [record] if record is not None else list(self.optimizers.values()):
            if each.unread is not None:
                skipped = int(each.unread.item())
                each.unread = None
                each.real -= skipped
                self.skipped_steps += skipped

    def unread_counts(self) -> list[torch.Tensor]:
        """The device's skip counts not read yet (each optimizer's, as they stand now)."""
        return [each.unread for each in self.optimizers.values() if each.unread is not None]

    def forget_unread(self) -> None:
        """Counters are being replaced (a checkpoint loads): the unread flags count for nothing."""
        for each in self.optimizers.values():
            each.unread = None

    def first_iteration(self, loader: Any, record: Any) -> bool:
        """Note ``loader`` when it is iterated for the first time in this session (True)."""
        if any(ref() is loader for ref in self.loader_order):
            return False
        self.loader_order.append(weakref.ref(loader))
        for hook in list(self.loader_hooks):
            hook(loader, record)
        return True

    def optimizer(self, optimizer: torch.optim.Optimizer) -> OptimizerRecord:
        record = self.optimizers.get(optimizer)
        if record is None:
            record = self.optimizers[optimizer] = OptimizerRecord()
        return record

    def optimizer_record(self, optimizer: torch.optim.Optimizer) -> OptimizerRecord | None:
        """``optimizers.get(optimizer)``, without a weak reference made per call."""
        last = self._last_optimizer
        if last is not None and last[0]() is optimizer:
            return last[1]
        record = self.optimizers.get(optimizer)
        if record is not None:
            self._last_optimizer = (weakref.ref(optimizer), record)
        return record

    def active_loader(self) -> LoaderIteration | None:
        """The loader that handed out a batch most recently started (an inner loop's)."""
        return self.loaders[-1] if self.loaders else None

    def driving_loader(self) -> LoaderIteration | None:
        """The outermost loader being iterated: it ends accumulation groups (not a side stream
        or an evaluation loop inside the training loop)."""
        return self.loaders[0] if self.loaders else None

    def params_in_play(self) -> list[torch.Tensor]:
        """Parameters of the optimizers met in this session."""
        params: dict[int, torch.Tensor] = {}
        for optimizer in list(self.optimizers):
            for group in optimizer.param_groups:
                params.update((id(p), p) for p in group["params"])
        return list(params.values())
