"""torch's pipeline schedules over a stage, for ``distributed(pp=N, loss_fn=f)``.

GPipe behind the plain loop (``_engines.pipeline``) runs the backward in the user's
``loss.backward()``, after every forward. 1F1B starts each micro-batch's backward as soon as
its forward left the last stage, which only a schedule that computes the loss itself can do:
with ``loss_fn=``, a call ``model(x, target=y)`` runs torch's ``Schedule1F1B`` (or
``ScheduleGPipe``) over this rank's stage, backward included, and returns the batch's loss (the
mean of the micro-batches' losses, as torch scales the gradients) on every stage.

torch's ``PipelineStage`` calls the stage module with the activation it received; the stage
module runs the user's model on the same cut as the plain loop does (``_engines.pipeline_cut``),
taking the user's inputs as keyword arguments, which torch cuts into micro-batches and hands to
every stage alike. A stage is made per micro-batch layout (torch infers the shapes it sends at
its first step): a last, smaller batch gets its own.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from typing_extensions import override

from .._job.job import Job
from .._kernel import state as _state
from ..errors import ConfigurationError
from .pipeline_cut import Mailbox, StageDone
from .pipeline_link import Link

_ARG = "_accel_ctx_arg"  # the user's positional inputs, passed as keywords to every stage


class _StageModule(nn.Module):
    """What torch's ``PipelineStage`` runs: the user's model, cut, on one micro-batch."""

    def __init__(self, model: nn.Module, mailbox: Mailbox, first: bool) -> None:
        super().__init__()
        self.model, self.mailbox, self.first = model, mailbox, first

    @override
    def forward(self, *received: torch.Tensor, **named: Any) -> Any:
        count = sum(1 for k in named if k.startswith(_ARG))
        args = [named.pop(f"{_ARG}{i}") for i in range(count)]
        self.mailbox.received = None if self.first else received[0]
        self.mailbox.entered = False
        try:
            return self.model(*args, **named)
        except StageDone as done:
            return done.activation
        finally:
            self.mailbox.received = None


def refuse_loss_scaling() -> None:
    """fp16's loss scaling: each stage would judge an overflow in its own gradients only, and
    skip its step (and change its scale) without the others."""
    stack = _state.current()
    for concern in stack.concerns if stack is not None else ():
        if concern.loss_scaling() is not None:
            raise ConfigurationError(
                "pp= with mixed_precision('fp16'): its loss scaling finds an overflow per stage, "
                "and a stage would skip its step while the others take theirs. Use "
                "mixed_precision('bf16') (no loss scaling) with a pipeline.")


def refuse_unsupported() -> None:
    """What a schedule that runs the backward inside the call cannot honour."""
    refuse_loss_scaling()
    stack = _state.current()
    for concern in stack.concerns if stack is not None else ():
        if concern.snapshot().get("accumulation_steps", 1) > 1:
            raise ConfigurationError(
                "pp= with loss_fn= inside accumulate(k): the schedule's backward runs inside "
                "the call, before accumulate() could divide the loss. Give the pipeline more "
                "micro-batches (microbatches=) instead, or use the plain loop (no loss_fn=).")


class Scheduled:
    """torch's schedule over this rank's stage; made per micro-batch layout."""

    def __init__(self, job: Job, model: nn.Module, mailbox: Mailbox, link: Link, stage: int,
                 loss_fn: Any, kind: str) -> None:
        where = job.coordinates
        self.job, self.stage, self.stages = job, stage, where.pp_size
        self.loss_fn, self.kind, self.link = loss_fn, kind, link
        module: nn.Module = _StageModule(model, mailbox, stage == 0)
        if where.dp_size > 1:  # torch's stage holds DDP's sync back to the last micro-batch
            module = nn.parallel.DistributedDataParallel(
                module, process_group=job.pp_mesh_2d["dp"].get_group(),
                find_unused_parameters=True)  # no bucket rebuild: it counts each micro-batch
        self.module = module
        self.device = next((p.device for p in model.parameters()), job.device)
        self.built: dict[tuple[Any, ...], Any] = {}

    def _schedule(self, count: int, named: dict[str, Any]) -> Any:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        key = (count, *((k, tuple(v.shape)) for k, v in named.items()
                        if isinstance(v, torch.Tensor)))
        schedule = self.built.get(key)
        if schedule is None:
            stage = PipelineStage(self.module, self.stage, self.stages, self.device,
                                  group=self.link.group)
            kind = Schedule1F1B if self.kind == "1f1b" else ScheduleGPipe
            schedule = self.built[key] = kind(stage, count, loss_fn=self.loss_fn)
        return schedule

    def step(self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any,
             count: int) -> torch.Tensor:
        """One training step's forwards and backwards; the batch's loss, on every stage."""
        named = {**{f"{_ARG}{i}": a for i, a in enumerate(args)}, **kwargs}
        losses: list[torch.Tensor] = []
        last = self.stage == self.stages - 1
        self._schedule(count, named).step(target=target if last else None,
                                          losses=losses if last else None, **named)
        value = (torch.stack([loss.detach().float() for loss in losses]).mean() if last
                 else torch.zeros((), device=self.device))
        dist.broadcast(value, self.link.last_rank, group=self.link.group)
        # the backward ran: the loop's loss.backward() on this loss has nothing left to do
        return value.requires_grad_()
