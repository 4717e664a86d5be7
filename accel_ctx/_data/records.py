"""What accel_ctx keeps about each DataLoader: the epoch being built, its passes, positions.

Kept in a weak table beside the loader (nothing on it): a loader dropped by the user takes its
record with it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import torch

from .._kernel.session import Session
from .shard import ShardPlan

RngStart = tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, ...]]
"""The random states an epoch drew its order from: torch's global generator's, the loader's own
generator's (None without one), and the other generators' found on its sampler, in walk order."""


class LoaderPass:
    """One ``iter(loader)`` inside a scope: what it started from and whether it ran to the end.

    A pass abandoned before its end with no backward in it (the DDP tutorial's
    ``next(iter(loader))`` peek, an evaluation cut short) is not an epoch: the loader's next
    pass takes its epoch number, and its resume position, over.
    """

    __slots__ = ("backward_start", "collectives_start", "exhausted", "metric_gathers_start",
                 "no_grad", "resume", "session", "where")

    def __init__(self, session: Session, resume: tuple[int, RngStart | None, int]) -> None:
        self.session = weakref.ref(session)  # the scopes it ran in
        self.backward_start = session.backward_calls  # the session's backward count then
        self.exhausted = False
        self.resume = resume  # (resume_skip, resume_rng, skip_batches) the pass consumed
        # for a pass sharded over several ranks (_eval_passes): the group's collectives and
        # gather_for_metrics calls at its start, and the user's line of the loop
        self.collectives_start: int | None = None
        self.metric_gathers_start = 0
        self.where = ""
        # iterated with gradients off, or the count of forwards without them at its start
        self.no_grad: bool | int = False


class LoaderRecord:
    """Per-DataLoader bookkeeping: the sharding plan of the epoch being built and positions."""

    __slots__ = (
        "__weakref__",
        "epoch",
        "epoch_plan",
        "epoch_start_rng",
        "indices",
        "last_pass",
        "plan",
        "resume_rng",
        "resume_skip",
        "skip_batches",
        "told_epochs",
        "view",
        "yielded",
    )

    def __init__(self) -> None:
        self.plan: ShardPlan | None = None  # set only while the stock iterator is being built
        self.view: object = None  # the sharding view handed to the stock iterator
        self.indices: Iterator[Any] | None = None  # the view's index iterator of this epoch
        self.epoch = 0  # epochs started inside a scope
        self.epoch_plan: ShardPlan | None = None  # the sharding plan of the current epoch
        self.yielded = 0  # batches of the current epoch handed to the user on this rank
        self.epoch_start_rng: RngStart | None = None  # RNG states the epoch drew its order from
        self.resume_skip = 0  # global batches to skip in the next epoch (checkpoint resume)
        self.resume_rng: RngStart | None = None  # epoch-start RNG states to replay (resume)
        self.skip_batches = 0  # skip_first_batches(): this rank's batches to skip next epoch
        self.told_epochs: dict[int, int] = {}  # id(sampler/dataset) -> epoch set_epoch() got
        self.last_pass: LoaderPass | None = None  # the latest iter() of the loader in a scope


_loader_records: weakref.WeakKeyDictionary[Any, LoaderRecord] = weakref.WeakKeyDictionary()


def loader_record(loader: Any) -> LoaderRecord:
    record = _loader_records.get(loader)
    if record is None:
        record = _loader_records[loader] = LoaderRecord()
    return record


def peek_loader_record(loader: Any) -> LoaderRecord | None:
    return _loader_records.get(loader)
