"""The pipeline engine: what a top-level call of a model runs under ``distributed(pp=N)``.

A model's first top-level call adopts it: every rank takes rank 0's weights, the model is cut
in place down to this rank's stage (``_engines.pipeline_cut``), the optimizers met before drop
the parameters other stages hold, and under data parallelism (world > pp) DDP averages the
stage's gradients over the "dp" dimension of the job's ``("dp", "pp")`` mesh.

Each call then runs GPipe behind the user's unchanged loop: the batch is cut into micro-batches,
each runs through the stages in turn (activations sent point to point), and the last stage's
output, whole, is handed to every stage, so ``model(x)`` returns the model's output on every
rank and the user's loss is the real loss everywhere. On the earlier stages that output is bound
by ``pipeline_link.Output`` to what the stage sent: the user's ``loss.backward()`` reaches
each micro-batch's ``Bound``, which receives the next stage's gradient for it, and autograd
carries on through that micro-batch's part of the stage while the next stage works on the
next. With ``loss_fn=``, a call given ``target=`` runs torch's own schedule instead
(``_engines.pipeline_schedule``: GPipe or 1F1B, the backward inside the call).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from typing_extensions import override

from .._job.job import Job
from .._kernel import state as _state
from .._kernel.session import Session
from ..errors import ConfigurationError
from . import adopt as _adopt
from . import fsdp as _fsdp
from . import records as _records
from . import replicate as _replicate
from .pipeline_cut import (
    AFTER_CALLED_BEFORE,
    NO_TENSOR,
    SKIPPED,
    Mailbox,
    StageCut,
    StageDone,
    StageProblem,
    cut,
)
from .pipeline_link import Bound, GradsBack, Link, Output
from .pipeline_schedule import Scheduled, refuse_loss_scaling, refuse_unsupported

# what a stage found wrong, sent on with the activation and shared with the output, so that
# every stage refuses the step alike (flag -> message)
_POISONED, _NOT_TENSOR = 1, 2
_PROBLEMS = {
    _POISONED: "the model's output at the first step is NaN. Either a value from before a stage's "
       "blocks reaches past them (a skip connection across stages, or a module output used by "
       "a later block besides the activation), which a pipeline cannot carry, or the model "
       "itself makes NaN.",
    _NOT_TENSOR: "the model returned something other than a tensor; a pipeline hands on one tensor "
       "(the logits). Return it alone, and compute the loss in the loop.",
    SKIPPED: "the forward returned before calling every block (a block skipped, or the blocks "
       "called in another order); a pipeline runs each block once, in order, on every call.",
    AFTER_CALLED_BEFORE:
        "a part registered after the model's blocks (so run by the last stage) was called "
        "before them{where}. Register it before the blocks in __init__, so that the first "
        "stage runs it.",
    NO_TENSOR: "a block{where} takes no tensor as its first argument (or as hidden_states); a "
               "pipeline carries one activation from block to block.",
}


def _micro(value: Any, rows: int, count: int) -> list[Any]:
    if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == rows:
        return list(value.tensor_split(count))
    return [value] * count


class PipelineRunner(nn.Module):
    """What a top-level call of a pipeline-parallel model runs (DDP wraps it over "dp")."""

    def __init__(self, job: Job, model: nn.Module, cut_: StageCut, mailbox: Mailbox) -> None:
        super().__init__()
        self.model = model  # registered: DDP averages the stage's parameters
        self.cut, self.mailbox = cut_, mailbox
        self.link = Link(job)
        self.microbatches = job.microbatches
        self.require_backward_grad_sync = True  # the Engine switch (DDP's, when over "dp")
        self.pending = False  # a forward with gradients whose backward has not run yet
        self.checked = False  # the first step's output was looked at for leaked placeholders
        self.expected = -1  # the micro-batch whose gradient the backward receives next
        loss_fn = job.options.loss_fn
        self.scheduled = None if loss_fn is None else Scheduled(
            job, model, mailbox, self.link, cut_.stage, loss_fn, job.options.schedule or "gpipe")

    @override
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        grad = torch.is_grad_enabled()
        if self.scheduled is None:
            return self._gpipe(args, kwargs, grad)
        target = kwargs.pop("target", None)
        if not grad:  # an evaluation: the forwards alone, the loss computed on every stage
            out = self._gpipe(args, kwargs, grad)
            return out if target is None else self.scheduled.loss_fn(out, target)
        if target is None:
            raise ConfigurationError(
                "pp= with loss_fn=: a training call runs torch's schedule, which computes the "
                "loss itself: call model(x, target=y), which returns the loss (then "
                "loss.backward() has nothing left to do), or drop loss_fn= for the plain loop.")
        refuse_unsupported()
        if not self.checked:  # the cut's checks, once: the first batch's forwards alone
            with torch.no_grad():
                self._gpipe(args, kwargs, False)
        return self.scheduled.step(args, kwargs, target, self._rows(args, kwargs)[1])

    def _rows(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int]:
        """The batch's rows and the micro-batches it is cut into."""
        rows = next((a.shape[0] for a in (*args, *kwargs.values())
                     if isinstance(a, torch.Tensor) and a.dim() >= 1), None)
        if rows is None:
            raise ConfigurationError(
                "pp=: the model was called without a batched tensor argument; a pipeline cuts "
                "the batch (dimension 0 of the inputs) into micro-batches.")
        return rows, max(1, min(self.microbatches, rows))

    def _gpipe(self, args: tuple[Any, ...], kwargs: dict[str, Any], grad: bool) -> Any:
        if grad:
            refuse_loss_scaling()
        if grad and self.pending:
            raise ConfigurationError(
                "pp=: a second forward with gradients before the first one's backward. Under "
                "a pipeline each training forward is followed by its loss.backward(): combine "
                "the outputs of several calls in one call (one batch), and run forwards whose "
                "outputs need no backward under torch.no_grad().")
        rows, count = self._rows(args, kwargs)
        parts = [_micro(a, rows, count) for a in args]
        named = {k: _micro(v, rows, count) for k, v in kwargs.items()}
        stage = self.cut
        tokens: list[torch.Tensor] = []
        outputs: list[torch.Tensor] = []
        back = GradsBack(self, count) if grad and stage.stage > 0 else None
        device = next((p.device for p in self.model.parameters()), self.link.device)
        problem, where = 0, ""  # every stage still passes each micro-batch on: none waits
        for i in range(count):
            if stage.stage > 0:
                received, flag = self.link.recv(device)
                problem = problem or flag  # an earlier stage refused the step: so does this one
                if not problem:
                    if back is not None and received.is_floating_point():
                        received.requires_grad_()
                        received.register_hook(back.hook(i))  # type: ignore[no-untyped-call]
                    self.mailbox.received = received
            if problem:
                if not stage.last:
                    self.link.send(torch.zeros(0, device=device), problem)
                continue
            self.mailbox.entered = False
            try:
                out = self.model(*(p[i] for p in parts), **{k: v[i] for k, v in named.items()})
            except StageDone as done:
                self.link.send(done.activation)
                if grad and done.activation.requires_grad:
                    tokens.append(Bound.apply(self, i, done.activation))  # type: ignore[no-untyped-call]
                continue
            except StageProblem as found:
                problem, where = found.code, f" ({found.where}, on this rank)"
                if not stage.last:
                    self.link.send(torch.zeros(0, device=device), problem)
                continue
            finally:
                self.mailbox.received = None
            if not stage.last:
                problem = SKIPPED
                self.link.send(torch.zeros(0, device=device), problem)
            elif not isinstance(out, torch.Tensor):
                problem = _NOT_TENSOR
            else:
                outputs.append(out)
        self.link.flush()
        self.pending = grad and not problem
        self.expected = count - 1  # the micro-batch whose gradient comes back first
        whole = None
        if stage.last:
            whole = torch.zeros(0, device=device) if problem else (
                outputs[0] if count == 1 else torch.cat(outputs))
            if not problem and not self.checked and bool(torch.isnan(whole.detach()).any()):
                problem = _POISONED
        values, problem = self.link.share_output(whole, problem, device)
        self.checked = True
        if problem:
            self.pending = False
            raise ConfigurationError(f"pp={stage.stages}: " + _PROBLEMS[problem].format(
                where=where))
        if stage.last:
            if not grad:
                self.pending = False
            return whole
        if tokens:
            return Output.apply(values, *tokens)  # type: ignore[no-untyped-call]
        self.pending = False
        return values


def prepare(job: Job, module: nn.Module, grad: bool, session: Session
            ) -> tuple[nn.Module, Any]:
    """What to call for a top-level call of ``module``, and its engine (or None)."""
    record = _adopt.root_record(job, module)
    if record is None:
        return module, None  # a part of an adopted model, or the user's own engine
    if _state.rank_only() is not None:
        raise ConfigurationError(
            f"pp={job.coordinates.pp_size}: a pipeline-parallel model was called in code that "
            "runs on some ranks only (@on_main_process, or under `if rank == 0`); its forward "
            "runs on every stage. Call it on every rank, outside the rank-only code.")
    if record.engine is None:
        record.engine = _build(job, module, session)
    engine = record.engine
    assert isinstance(engine, nn.Module)
    if not grad and isinstance(engine, nn.parallel.DistributedDataParallel):
        return engine.module, engine.module
    return engine, engine


def _build(job: Job, module: nn.Module, session: Session
           ) -> PipelineRunner | nn.parallel.DistributedDataParallel:
    if "_orig_mod" in module._modules:
        raise ConfigurationError(
            f"pp={job.coordinates.pp_size}: torch.compile(model) with a pipeline is not "
            "supported yet; pass the model itself.")
    if any(t.is_meta for t in module.parameters()):
        raise ConfigurationError(
            f"pp={job.coordinates.pp_size}: this {type(module).__name__} was built on the meta "
            "device, which the pipeline does not take yet. Build it on the CPU.")
    where = job.coordinates
    mailbox = Mailbox()
    _fsdp.broadcast_from_rank0(job, module)  # every stage starts from rank 0's weights
    stage = cut(module, where.pp_rank, where.pp_size, mailbox)
    for param in stage.removed:
        job.adoption.replaced[id(param)] = (weakref.ref(param), None)
    _adopt.move_to_device(job, module)
    for optimizer in list(session.optimizers.keys()):
        _adopt.adopt_optimizer(job, optimizer)  # met before: only this stage's parameters
    runner = PipelineRunner(job, module, stage, mailbox)
    if where.dp_size == 1 or not any(p.requires_grad for p in module.parameters()) or (
            runner.scheduled is not None):  # torch's stage runs DDP over the stage itself
        return runner
    return _replicate.build_ddp(job, runner, job.pp_mesh_2d["dp"].get_group())


def whole_norm(job: Job, norm: torch.Tensor, norm_type: float) -> torch.Tensor:
    """A gradient norm over every stage's parameters, from this stage's ``norm``."""
    group = job.pp_mesh_2d["pp"].get_group()
    if norm_type == float("inf"):
        total = norm.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        return total
    powered = norm.detach().double() ** norm_type
    dist.all_reduce(powered, group=group)
    return (powered ** (1.0 / norm_type)).to(norm.dtype)


def full_state_dict(module: nn.Module) -> dict[str, Any] | None:
    """The whole model's weights, on every stage (``save_model``): each stage's part, gathered
    over the pipeline; None for a model that is not cut."""
    job = _state.current_job()
    record = _records.module_record(module)
    if job is None or record is None or not record.engine or job.coordinates.pp_size == 1:
        return None
    mine = {k: v.detach().cpu() for k, v in module.state_dict().items()}
    parts: list[Any] = [None] * job.coordinates.pp_size
    dist.all_gather_object(parts, mine, group=job.pp_mesh_2d["pp"].get_group())
    return {k: v for part in parts for k, v in part.items()}  # in stage order: the model's
