"""The pipeline engine: what a top-level call of a model runs under ``distributed(pp=N)``.

A model's first top-level call adopts it: every rank takes rank 0's weights, the model is cut
in place down to this rank's stage (``_engines.pipeline_cut``), the optimizers met before drop
the parameters other stages hold, and under data parallelism (world > pp) DDP averages the
stage's gradients over the "dp" dimension of the job's ``("dp", "pp")`` mesh.

Each call then runs GPipe behind the user's unchanged loop: the batch is cut into micro-batches,
each runs through the stages in turn (activations sent point to point), and the last stage's
output, whole, is handed to every stage, so ``model(x)`` returns the model's output on every
rank and the user's loss is the real loss everywhere. On the earlier stages that output is bound
by :class:`_Bound` to what the stage sent: the user's ``loss.backward()`` reaches its
``backward``, which receives the next stage's gradients for them, and autograd carries on
through the stage (torch's own schedules need the loss inside them: ``loss_fn=``, not this).
"""

from __future__ import annotations

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

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
           torch.int32, torch.bool, torch.uint8, torch.int8, torch.int16)
_HEADER = 10  # ndim, dtype, flag, shape (up to 7 dimensions)
# what a stage found wrong, sent on with the activation and shared with the output, so that
# every stage refuses the step alike (flag -> message)
_PROBLEMS = {
    1: "the model's output at the first step is NaN. Either a value from before a stage's "
       "blocks reaches past them (a skip connection across stages, or a module output used by "
       "a later block besides the activation), which a pipeline cannot carry, or the model "
       "itself makes NaN.",
    2: "the model returned something other than a tensor; a pipeline hands on one tensor "
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
_POISONED, _NOT_TENSOR, _EARLY = 1, 2, SKIPPED


class _Link:
    """Point-to-point and broadcast traffic of one pipeline (the "pp" mesh dimension)."""

    def __init__(self, job: Job) -> None:
        where = job.coordinates
        self.group = job.pp_mesh_2d["pp"].get_group()
        self.device = job.comm_device(job.device)
        self.prev, self.next = job.rank - 1, job.rank + 1
        self.last_rank = job.rank - where.pp_rank + where.pp_size - 1

    def _header(self, tensor: torch.Tensor, flag: int) -> torch.Tensor:
        if tensor.dim() > _HEADER - 3:
            raise ConfigurationError(
                f"pp=: a tensor of {tensor.dim()} dimensions cannot pass between stages "
                f"(up to {_HEADER - 3}).")
        values = [tensor.dim(), _DTYPES.index(tensor.dtype), flag, *tensor.shape]
        return torch.tensor(values + [0] * (_HEADER - len(values)), dtype=torch.int64,
                            device=self.device)

    @staticmethod
    def _empty(header: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, int]:
        ndim, dtype, flag, *shape = header.tolist()
        return torch.empty(shape[:ndim], dtype=_DTYPES[dtype], device=device), flag

    def send(self, tensor: torch.Tensor, flag: int = 0) -> None:
        dist.send(self._header(tensor, flag), self.next, group=self.group)
        dist.send(tensor.detach().contiguous(), self.next, group=self.group)

    def recv(self, device: torch.device) -> tuple[torch.Tensor, int]:
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        dist.recv(header, self.prev, group=self.group)
        tensor, flag = self._empty(header, device)
        dist.recv(tensor, self.prev, group=self.group)
        return tensor, flag

    def share_output(self, output: torch.Tensor | None, flag: int, device: torch.device
                     ) -> tuple[torch.Tensor, int]:
        """The last stage's output, on every stage of the pipeline, with the last's flag."""
        header = (self._header(output, flag) if output is not None
                  else torch.empty(_HEADER, dtype=torch.int64, device=self.device))
        dist.broadcast(header, self.last_rank, group=self.group)
        if output is not None:
            dist.broadcast(output.detach().contiguous(), self.last_rank, group=self.group)
            return output, flag
        values, flag = self._empty(header, device)
        dist.broadcast(values, self.last_rank, group=self.group)
        return values, flag


class _Bound(torch.autograd.Function):
    """The output on an earlier stage: its values the last stage's, its backward the next
    stage's gradients for the activations this stage sent (the loss's own gradient here is
    the same loss's on the last stage, already in them)."""

    @staticmethod
    @override
    def forward(ctx: Any, values: torch.Tensor, runner: PipelineRunner,
                *sent: torch.Tensor) -> torch.Tensor:
        ctx.runner = runner
        ctx.shapes = [(s.shape, s.dtype, s.device) for s in sent]
        return values.detach()

    @staticmethod
    @override
    def backward(ctx: Any, *grad: torch.Tensor) -> tuple[Any, ...]:
        runner: PipelineRunner = ctx.runner
        grads = []
        for shape, dtype, device in ctx.shapes:
            buffer = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(buffer, runner.link.next, group=runner.link.group)
            grads.append(buffer)
        if runner.cut.stage == 0:
            runner.pending = False
        return (None, None, *grads)


class _GradsBack:
    """A later stage's gradients of the activations it received, sent back in the order they
    came once the backward has made them all (autograd makes them in its own order)."""

    def __init__(self, runner: PipelineRunner, count: int) -> None:
        self.runner = runner
        self.grads: list[torch.Tensor | None] = [None] * count
        self.left = count

    def hook(self, index: int) -> Any:
        def got(grad: torch.Tensor) -> None:
            self.grads[index] = grad
            self.left -= 1
            if self.left == 0:
                link = self.runner.link
                for made in self.grads:
                    assert made is not None
                    dist.send(made.contiguous(), link.prev, group=link.group)
                self.runner.pending = False
        return got


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
        self.link = _Link(job)
        self.microbatches = job.microbatches
        self.require_backward_grad_sync = True  # the Engine switch (DDP's, when over "dp")
        self.pending = False  # a forward with gradients whose backward has not run yet
        self.checked = False  # the first step's output was looked at for leaked placeholders

    @override
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        grad = torch.is_grad_enabled()
        if grad and self.pending:
            raise ConfigurationError(
                "pp=: a second forward with gradients before the first one's backward. Under "
                "a pipeline each training forward is followed by its loss.backward(): combine "
                "the outputs of several calls in one call (one batch), and run forwards whose "
                "outputs need no backward under torch.no_grad().")
        rows = next((a.shape[0] for a in (*args, *kwargs.values())
                     if isinstance(a, torch.Tensor) and a.dim() >= 1), None)
        if rows is None:
            raise ConfigurationError(
                "pp=: the model was called without a batched tensor argument; a pipeline cuts "
                "the batch (dimension 0 of the inputs) into micro-batches.")
        count = max(1, min(self.microbatches, rows))
        parts = [_micro(a, rows, count) for a in args]
        named = {k: _micro(v, rows, count) for k, v in kwargs.items()}
        stage = self.cut
        sent: list[torch.Tensor] = []
        outputs: list[torch.Tensor] = []
        back = _GradsBack(self, count) if grad and stage.stage > 0 else None
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
                sent.append(done.activation)
                continue
            except StageProblem as found:
                problem, where = found.code, f" ({found.where}, on this rank)"
                if not stage.last:
                    self.link.send(torch.zeros(0, device=device), problem)
                continue
            finally:
                self.mailbox.received = None
            if not stage.last:
                problem = _EARLY
                self.link.send(torch.zeros(0, device=device), problem)
            elif not isinstance(out, torch.Tensor):
                problem = _NOT_TENSOR
            else:
                outputs.append(out)
        self.pending = grad and not problem
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
        if grad and any(s.requires_grad for s in sent):
            return _Bound.apply(values, self, *sent)  # type: ignore[no-untyped-call]
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
        job.adoption.replaced[id(param)] = (_weak(param), None)
    _adopt.move_to_device(job, module)
    for optimizer in list(session.optimizers.keys()):
        _adopt.adopt_optimizer(job, optimizer)  # met before: only this stage's parameters
    runner = PipelineRunner(job, module, stage, mailbox)
    if where.dp_size == 1 or not any(p.requires_grad for p in module.parameters()):
        return runner
    devices = {p.device for p in module.parameters()}
    single_cuda = len(devices) == 1 and next(iter(devices)).type == "cuda"
    opts = job.options
    return nn.parallel.DistributedDataParallel(
        runner, device_ids=[next(iter(devices))] if single_cuda else None,
        process_group=job.pp_mesh_2d["dp"].get_group(),
        find_unused_parameters=opts.find_unused_parameters,
        gradient_as_bucket_view=opts.gradient_as_bucket_view, static_graph=opts.static_graph)


def _weak(param: nn.Parameter) -> Any:
    import weakref

    return weakref.ref(param)


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
