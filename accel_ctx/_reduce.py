"""reduce() without a separate shape check: a signature packed into the data's own all_reduce.

An all_reduce whose buffers differ between ranks fails badly on gloo: the rank that receives
more bytes than it expects aborts the process (SIGABRT), and the other one may return a
plausible sum of the common prefix. So the first message of every reduce() has the same size and
dtype on every rank whatever they pass: ``SLOTS`` float64 values, ``_HEAD`` of them a signature
of the call (a hash of the structure, shapes, dtypes and op, cut into 16-bit pieces) and the
rest the data itself when it fits (float64 holds every float16/bfloat16/float32/float64 value
and every integer up to 2**53 exactly). Each piece ``s`` travels as the pair ``(s, s*s)`` for a
sum (after it, ``sum(s) == W*s`` and ``sum(s*s) == W*s*s`` hold on a rank only if every rank
sent the same ``s``) and as ``(s, -s)`` for max/min (both extremes equal ``s``). The reduced
buffer is the same on every rank, so every rank sees a mismatch, then trades readable
descriptions and raises. A matching call that fits costs one all_reduce, as before; a larger
one sends its data in the usual per-dtype all_reduces after this small first one. (Ranks in
reductions with different native ops, "sum" on one and "max" on another, break that argument:
the header then comes out as neither expects, which is caught as well on gloo, but only debug
mode promises it; "mean" against "sum" differs in the signature and is always caught.)

Sums are computed in float64 and rounded once to the tensor's dtype (never less exact than
summing in that dtype). Integers that could leave float64's exact range (``W * |x| > 2**53``)
raise a flag in the same message, and their tensors are then reduced again in int64.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ._exchange import Described, mismatch
from ._job import Job

SLOTS = 256  # float64 values in reduce's first message (2 KiB): its size never varies
_PIECES = 4  # 16-bit pieces of the 64-bit signature hash
_FLAG = 2 * _PIECES  # the slot flagging integers too large for float64
_HEAD = _FLAG + 1
_EXACT = {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
          torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool}
_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN}


def reduce_tensors(job: Job, described: Described, op: str, device: torch.device,
                   advice: str, call: str) -> list[torch.Tensor]:
    """Every rank's tensors of ``described`` reduced with ``op``, checked to match first."""
    leaves = described.tensors
    world = job.world_size
    pieces = [((described.digest >> (16 * i)) & 0xFFFF) + 1 for i in range(_PIECES)]
    summing = op in ("sum", "mean")
    head = [float(v) for s in pieces for v in ((s, s * s) if summing else (s, -s))]
    numel = sum(t.numel() for t in leaves)
    inline = numel <= SLOTS - _HEAD and all(t.dtype in _EXACT for t in leaves)
    buffer = torch.zeros(SLOTS, dtype=torch.float64, device=device)
    buffer[:_FLAG] = torch.tensor(head, dtype=torch.float64)
    large: list[int] = [i for i, t in enumerate(leaves) if t.dtype == torch.int64]
    if inline and leaves:
        flat = torch.cat([t.detach().reshape(-1).to(device, torch.float64) for t in leaves])
        buffer[_HEAD:_HEAD + numel] = flat
        if large:  # no host sync: the flag is computed where the data is
            bound = 2.0**53 / (world if summing else 1)
            big = torch.stack([(leaves[i].detach().to(device).abs().double() > bound).any()
                               for i in large]).any().double()
            buffer[_FLAG] = -big if op == "min" else big
    dist.all_reduce(buffer, _OPS[op])
    got = buffer[:_HEAD].tolist()
    expected = [v * world if summing else v for v in head]
    if got[:_FLAG] != expected:
        mismatch(job, described, call, advice)
    results: dict[int, torch.Tensor] = {}
    if inline:
        redo = set(large) if got[_FLAG] != 0 else set()
        offset = _HEAD
        for i, t in enumerate(leaves):
            part = buffer[offset:offset + t.numel()]
            offset += t.numel()
            if i not in redo:
                results[i] = _finish(part, t, op, world)
        rest = sorted(redo)
    else:
        rest = list(range(len(leaves)))
    results.update(_native(job, leaves, rest, op))
    return [results[i] for i in range(len(leaves))]


def _finish(part: torch.Tensor, t: torch.Tensor, op: str, world: int) -> torch.Tensor:
    if op == "mean":
        part = part / world
        dtype = t.dtype if t.dtype.is_floating_point else torch.get_default_dtype()
    else:
        dtype = t.dtype
    return part.view(t.shape).to(t.device, dtype)


def _native(job: Job, leaves: list[torch.Tensor], indices: list[int],
            op: str) -> dict[int, torch.Tensor]:
    """One all_reduce per dtype and device, in each tensor's own dtype."""
    groups: dict[Any, list[int]] = {}
    for i in indices:
        # keyed by where the data travels, which the signature checked: the same on every rank
        travel = job.comm_device(leaves[i].device).type
        groups.setdefault((leaves[i].dtype, travel), []).append(i)
    results: dict[int, torch.Tensor] = {}
    for group in groups.values():
        device = job.comm_device(leaves[group[0]].device)
        flat = torch.cat([leaves[i].detach().reshape(-1).to(device) for i in group])
        dist.all_reduce(flat, _OPS[op])
        if op == "mean":
            flat = flat / job.world_size
        sizes = [leaves[i].numel() for i in group]
        for i, part in zip(group, torch.split(flat, sizes), strict=True):
            results[i] = part.view(leaves[i].shape).to(leaves[i].device)
    return results
