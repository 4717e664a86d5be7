"""reduce() whose first message is the header every collective starts with, data inside.

An all_reduce whose buffers differ between ranks fails badly on gloo: the rank that receives
more bytes than it expects aborts the process (SIGABRT), and the other one may return a
plausible sum of the common prefix. And a rank in reduce() while another is in gather() would
pair an all_reduce with an all_gather. So reduce() opens, as every collective does, with the
header of ``_ranks.exchange`` (one all_gather of ``HEADER`` int64s per rank, the same size whatever
the ranks pass or call), which checks the calls against each other before anything else. A
small reduction travels inside that header: up to ``INLINE`` values, floats as the bits of a
float64 (which holds every float16/bfloat16/float32/float64 value exactly), integers and bools
as int64; every rank then combines the ranks' rows itself, in the same way, so every rank gets
the same result from one message. A larger one sends its data in the usual per-dtype
all_reduces after the header.

Sums of floating-point values are exact and rounded once to the tensor's dtype (``math.fsum``:
never less exact than summing in that dtype, and the same bits on every machine); integer sums
are computed in int64, as torch's own all_reduce of an int64 tensor does.

Under tensor parallelism the ranks of one tp group evaluate the same batch, so a sum of
per-sample counts over every rank would count each sample ``tp_size`` times: each
data-parallel group is counted once, by its tp rank 0 (``counted``), the others taking part
with the operation's identity. Every rank still gets the same result.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from .._job.job import Job
from .exchange import FIXED, INLINE, Described, header

_FLOATS = {torch.float64, torch.float32, torch.float16, torch.bfloat16}
_INTEGERS = {torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool}
_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN}


def reduce_tensors(job: Job, described: Described, op: str, device: torch.device,
                   advice: str) -> list[torch.Tensor]:
    """Every rank's tensors of ``described`` reduced with ``op``, checked to match first."""
    leaves = described.tensors
    numel = sum(t.numel() for t in leaves)
    inline = numel <= INLINE and all(t.dtype in _FLOATS | _INTEGERS for t in leaves)
    values: list[int] = []
    if inline and leaves:
        values = torch.cat([_as_int64(t.detach().reshape(-1).cpu()) for t in leaves]).tolist()
    rows = header(job, described, device, advice, inline=values)
    if not inline:
        return _native(job, leaves, op)
    tp = job.coordinates.sharers
    data = torch.tensor([row[FIXED:FIXED + numel] for r, row in enumerate(rows) if r % tp == 0],
                        dtype=torch.int64)
    results, offset = [], 0
    for t in leaves:
        part = data[:, offset:offset + t.numel()]
        offset += t.numel()
        results.append(_combine(part, t, op, len(data)))
    return results


def counted(job: Job) -> bool:
    """Whether this rank's values count: one rank per data-parallel group (its tp or sp rank 0)."""
    return job.coordinates.rank % job.coordinates.sharers == 0


def _identity(t: torch.Tensor, op: str) -> torch.Tensor:
    """What a rank that does not count contributes: nothing changes the result."""
    if op in ("sum", "mean"):
        return torch.zeros_like(t)
    if t.dtype == torch.bool:
        return torch.full_like(t, op == "min")
    big = math.inf if t.dtype.is_floating_point else torch.iinfo(t.dtype).max
    low = -math.inf if t.dtype.is_floating_point else torch.iinfo(t.dtype).min
    return torch.full_like(t, low if op == "max" else big)


def _as_int64(flat: torch.Tensor) -> torch.Tensor:
    """Floats as the bits of their float64 value, integers and bools as int64 (both exact)."""
    if flat.dtype in _FLOATS:
        return flat.to(torch.float64).view(torch.int64)
    return flat.to(torch.int64)


def _combine(part: torch.Tensor, t: torch.Tensor, op: str, world: int) -> torch.Tensor:
    """Every rank's values of ``t`` (one row per rank) combined, in ``t``'s shape and dtype."""
    floating = t.dtype in _FLOATS
    values = part.contiguous().view(torch.float64) if floating else part
    if op in ("max", "min"):
        out = values.amax(dim=0) if op == "max" else values.amin(dim=0)
    elif floating:  # exact, whatever the order: the same bits on every rank and machine
        out = torch.tensor([math.fsum(col) for col in zip(*values.tolist(), strict=True)],
                           dtype=torch.float64).reshape(values.shape[1:])
    else:
        out = values.sum(dim=0)
    if op == "mean":
        out = out.to(torch.float64) / world
        dtype = t.dtype if floating else torch.get_default_dtype()
    else:
        dtype = t.dtype
    return out.view(t.shape).to(t.device, dtype)


def _native(job: Job, leaves: list[torch.Tensor], op: str) -> list[torch.Tensor]:
    """One all_reduce per dtype and device, in each tensor's own dtype."""
    groups: dict[Any, list[int]] = {}
    for i, t in enumerate(leaves):
        # keyed by where the data travels, which the header checked: the same on every rank
        groups.setdefault((t.dtype, job.comm_device(t.device).type), []).append(i)
    results: dict[int, torch.Tensor] = {}
    for group in groups.values():
        device = job.comm_device(leaves[group[0]].device)
        flat = torch.cat([leaves[i].detach().reshape(-1).to(device) for i in group])
        if not counted(job):
            flat = _identity(flat, op)
        dist.all_reduce(flat, _OPS[op])
        if op == "mean":
            flat = flat / job.coordinates.dp_size
        sizes = [leaves[i].numel() for i in group]
        for i, part in zip(group, torch.split(flat, sizes), strict=True):
            results[i] = part.view(leaves[i].shape).to(leaves[i].device)
    return [results[i] for i in range(len(leaves))]
