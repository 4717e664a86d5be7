"""A pipeline's traffic: activations and gradients point to point, the output to every stage.

Every tensor is preceded by a small header (its dimensions, dtype, shape and a flag), since the
receiving stage does not know what comes: the flag carries a stage's refusal of the step on to
the others (``_engines.pipeline``), so that no stage is left waiting for a tensor that never
comes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from typing_extensions import override

from .._job.job import Job
from ..errors import ConfigurationError

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
           torch.int32, torch.bool, torch.uint8, torch.int8, torch.int16)
_HEADER = 10  # ndim, dtype, flag, shape (up to 7 dimensions)
class Link:
    """Point-to-point and broadcast traffic of one pipeline (the "pp" mesh dimension)."""

    def __init__(self, job: Job) -> None:
        where = job.coordinates
        self.group = job.pp_mesh_2d["pp"].get_group()
        self.device = job.comm_device(job.device)
        self.prev, self.next = job.rank - 1, job.rank + 1
        self.last_rank = job.rank - where.pp_rank + where.pp_size - 1
        self.sending: list[tuple[Any, torch.Tensor]] = []  # (work, the tensor it holds)

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
        """Sent without waiting (gloo's send waits for the receiver's recv): the stage goes on
        with its next micro-batch; :meth:`flush` waits for what is still on its way."""
        for part in (self._header(tensor, flag), tensor.detach().contiguous()):
            self.sending.append((dist.isend(part, self.next, group=self.group), part))

    def send_back(self, grad: torch.Tensor) -> None:
        part = grad.contiguous()
        self.sending.append((dist.isend(part, self.prev, group=self.group), part))

    def flush(self) -> None:
        for work, _ in self.sending:
            work.wait()
        self.sending.clear()

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


class Bound(torch.autograd.Function):
    """One micro-batch's activation sent on, as autograd sees it on an earlier stage: made
    right after that micro-batch's forward, so the backward reaches it (micro-batches in reverse,
    autograd's order) just before that micro-batch's own part of the stage; its backward
    receives the next stage's gradient for the activation. Its output is a token that
    :class:`Output` ties to the stage's output."""

    @staticmethod
    @override
    def forward(ctx: Any, runner: Any, index: int, sent: torch.Tensor) -> torch.Tensor:
        ctx.runner, ctx.index = runner, index
        ctx.shape = (sent.shape, sent.dtype, sent.device)
        return sent.new_zeros(())

    @staticmethod
    @override
    def backward(ctx: Any, *grad: torch.Tensor) -> tuple[Any, ...]:
        runner: Any = ctx.runner
        if ctx.index != runner.expected:  # the next stage sends them in reverse, one by one
            raise RuntimeError(
                f"pp: micro-batch {ctx.index}'s backward came where {runner.expected}'s was due; "
                "the stages would pair up the wrong gradients.")
        runner.expected -= 1
        shape, dtype, device = ctx.shape
        buffer = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(buffer, runner.link.next, group=runner.link.group)
        if runner.expected < 0 and runner.cut.stage == 0:
            runner.pending = False
        return None, None, buffer


class Output(torch.autograd.Function):
    """An earlier stage's output: the last stage's values, tied to the micro-batches' tokens."""

    @staticmethod
    @override
    def forward(ctx: Any, values: torch.Tensor, *tokens: torch.Tensor) -> torch.Tensor:
        ctx.count = len(tokens)
        return values.detach()

    @staticmethod
    @override
    def backward(ctx: Any, *grad: torch.Tensor) -> tuple[Any, ...]:
        # the loss's gradient here is the same loss's on the last stage, already in what the
        # next stage sends: each token only wakes its micro-batch's Bound
        return (None, *(grad[0].new_zeros(()) for _ in range(ctx.count)))


class GradsBack:
    """A later stage's gradients of the activations it received, sent back as autograd makes
    them, last micro-batch first (the order the earlier stage's backward takes them in)."""

    def __init__(self, runner: Any, count: int) -> None:
        self.runner = runner
        self.grads: list[torch.Tensor | None] = [None] * count
        self.next = count - 1

    def hook(self, index: int) -> Any:
        def got(grad: torch.Tensor) -> None:
            self.grads[index] = grad
            link = self.runner.link
            while self.next >= 0 and (made := self.grads[self.next]) is not None:
                link.send_back(made)
                self.grads[self.next] = None
                self.next -= 1
            if self.next < 0:
                link.flush()
                self.runner.pending = False
        return got
