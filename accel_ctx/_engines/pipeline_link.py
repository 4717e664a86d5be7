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


class Bound(torch.autograd.Function):
    """The output on an earlier stage: its values the last stage's, its backward the next
    stage's gradients for the activations this stage sent (the loss's own gradient here is
    the same loss's on the last stage, already in them)."""

    @staticmethod
    @override
    def forward(ctx: Any, values: torch.Tensor, runner: Any,
                *sent: torch.Tensor) -> torch.Tensor:
        ctx.runner = runner
        ctx.shapes = [(s.shape, s.dtype, s.device) for s in sent]
        return values.detach()

    @staticmethod
    @override
    def backward(ctx: Any, *grad: torch.Tensor) -> tuple[Any, ...]:
        runner: Any = ctx.runner
        grads = []
        for shape, dtype, device in ctx.shapes:
            buffer = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(buffer, runner.link.next, group=runner.link.group)
            grads.append(buffer)
        if runner.cut.stage == 0:
            runner.pending = False
        return (None, None, *grads)


class GradsBack:
    """A later stage's gradients of the activations it received, sent back in the order they
    came once the backward has made them all (autograd makes them in its own order)."""

    def __init__(self, runner: Any, count: int) -> None:
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


