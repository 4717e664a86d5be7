"""``distributed(even_batches=False)``: the batch only some ranks get, under DDP's ``Join``.

When an epoch's batches do not divide by the number of ranks, the last round is incomplete:
ranks ``0 .. m-1`` get one batch more than the others. Training on it with gradient sync would
leave those ranks waiting in DDP's all-reduce for ranks that have left the loop. torch's own
engine for uneven inputs, :class:`torch.distributed.algorithms.join.Join`, is used for exactly
that round: a rank with the extra batch enters it before handing the batch out (so DDP's
forward notifies it), a rank without one enters and leaves it at the end of its loop, which
shadows the others' collectives until every rank is done; then every rank takes the model of
the last rank to finish, as ``with Join([ddp_model]): <loop>`` written by hand does.

``gather_for_metrics`` takes part in the same Join: in that round a rank without a batch
repeats its calls of its last batch flagged as padding (dropped, as with ``even_batches``), so
an evaluation sees every sample exactly once with nothing padded.

Join is entered only when the epoch's complete rounds trained exactly one model with DDP or
called ``gather_for_metrics``, so that every rank makes the same decision without talking;
loops with neither are left alone. Join costs its collectives in that one round only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook, _JoinConfig
from typing_extensions import override

from .._job.job import Adoption, Job
from ..errors import ConfigurationError, DistributedError
from . import records as _records

LAST_FORWARD = "_accel_ctx_last_forward"  # in a DDP engine's __dict__: its last forward's number


def _no_gather_yet(job: Any, obj: Any, padding: bool) -> Any:
    """The Join replays gathers only after a ``note_gather``, which sets the real one."""
    raise AssertionError("a gather_for_metrics replay before any note_gather")


class UnevenTail:
    """One epoch of one loader whose last round may be incomplete (``even_batches=False``)."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.adoption = job.adoption
        self.rank = job.rank
        self.adoption.uneven_tail = None  # a loop left by an exception may have left it set
        self.start = self.adoption.forwards
        self._join: Join | None = None
        self._engine: Any = None
        self._metrics: _MetricsJoinable | None = None
        self.gathers: list[Any] = []  # gather_for_metrics inputs of the last complete batch
        self._gather_index = -1
        self._tail_batch: int | None = None  # this rank's batch of the incomplete round
        self._notified = -1
        self.regather: Callable[[Any, Any, bool], Any] = _no_gather_yet  # set by note_gather

    def _engines_used(self) -> list[Any]:
        engines = []
        for module in list(self.adoption.modules):
            record = _records.module_record(module)
            engine = record.engine if record is not None else None
            if engine and engine.__dict__.get(LAST_FORWARD, 0) > self.start:
                engines.append((engine.__dict__[LAST_FORWARD], engine))
        return [engine for _, engine in sorted(engines, key=lambda pair: pair[0])]

    def note_gather(self, obj: Any, batch: int, regather: Callable[[Any, Any, bool], Any]
                    ) -> None:
        """A gather_for_metrics call for ``batch``: remembered, or announced to the Join."""
        self.regather = regather  # _ranks.evaluation's gather, for the Join's replays
        if self._tail_batch is None or batch != self._tail_batch:
            if batch != self._gather_index:
                self.gathers, self._gather_index = [], batch
            self.gathers.append(obj)
            return
        if self._metrics is None:
            raise DistributedError(
                f"rank {self.rank}: gather_for_metrics() in batch {batch}, from the epoch's last, "
                "incomplete round that distributed(even_batches=False) gives only some ranks: "
                "the others have left the loop and cannot take part. accel_ctx lets them take "
                "part when the epoch's complete rounds called it as well, and this epoch's did "
                "not (it may have fewer batches than ranks). Use distributed(even_batches=True) "
                "(the default: gather_for_metrics drops the padding)."
            )
        if self._notified != batch:  # once per batch, before its first collective
            self._notified = batch
            work = Join.notify_join_context(self._metrics)
            if work is not None:
                work.wait()

    def enter(self, batch: int | None) -> None:
        """The incomplete round starts here (``batch``: this rank's batch of it, if any)."""
        engines = self._engines_used()
        if len(engines) > 1:
            raise ConfigurationError(
                f"rank {self.rank}: distributed(even_batches=False) gives some ranks one batch "
                f"more than others at the end of this epoch, and the loop trains {len(engines)} "
                "models with DDP. torch's Join, which lets the ranks without that batch shadow "
                "it, handles one model per loop. Use distributed(even_batches=True) (the "
                "default: the last round is padded) or DataLoader(drop_last=True), or make the "
                "models parts of one nn.Module."
            )
        joinables: list[Joinable] = list(engines)
        if self.gathers:
            self._metrics = _MetricsJoinable(self)
            joinables.append(self._metrics)
        self._tail_batch = batch
        if not joinables:
            if batch is not None:
                self.adoption.uneven_tail = (
                    f"rank {self.rank}: distributed(even_batches=False) gave this rank batch "
                    f"{batch} of the epoch, from its last, incomplete round, which some ranks "
                    "do not get, and this forward would synchronise gradients with them: they "
                    "have left the loop, so it would wait for them forever. accel_ctx starts "
                    "DDP's Join for that round only when the epoch's complete rounds trained a "
                    "model, and this epoch's did not (it may have fewer batches than ranks). Use "
                    "distributed(even_batches=True) (the default) or DataLoader(drop_last=True)."
                )
            return
        self._engine = engines[0] if engines else None
        self._join = Join(joinables)
        self._join.__enter__()  # type: ignore[no-untyped-call]

    def finish(self, had_batch: bool) -> None:
        """This rank's loop is over: wait, shadowing, until every rank's is."""
        try:
            if not had_batch:
                self.enter(None)
            if self._join is not None:
                self._join.__exit__(None, None, None)
        finally:
            self.adoption.uneven_tail = None
            if self._engine is not None:  # later forwards must not notify a Join any more
                self._engine._join_config = _JoinConfig.construct_disabled_join_config()  # type: ignore[no-untyped-call]
            self._join = self._engine = self._metrics = None


def refuse_forward(adoption: Adoption) -> None:
    """A forward that would sync gradients in an incomplete round no Join covers."""
    message = adoption.uneven_tail
    adoption.uneven_tail = None
    raise DistributedError(message)


class _MetricsJoinable(Joinable):
    """gather_for_metrics in the incomplete round: the ranks without a batch take part empty."""

    def __init__(self, tail: UnevenTail) -> None:
        super().__init__()
        self.tail = tail
        job = tail.job
        self._device = job.comm_device(torch.device("cpu"))

    @override
    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _MetricsHook(self.tail)

    @property
    @override
    def join_device(self) -> torch.device:
        return self._device

    @property
    @override
    def join_process_group(self) -> Any:
        return dist.distributed_c10d._get_default_group()


class _MetricsHook(JoinHook):
    def __init__(self, tail: UnevenTail) -> None:
        self.tail = tail

    @override
    def main_hook(self) -> None:
        """Repeat this rank's calls of its last batch, flagged as padding (dropped)."""
        for obj in self.tail.gathers:
            self.tail.regather(self.tail.job, obj, True)
