"""Scripts without a DataLoader: every rank fed the same batch trains the same replica.

nanoGPT's ``get_batch`` and the word language model's ``batchify`` make their batches
themselves; wrapped as they are, every rank trains on the same tensors unless the script
slices them by rank, so W processes train W identical copies at W times the cost of one.

From the job's first training forward through an engine, each forward notes a fingerprint of its
inputs and the backward that follows notes its loss, all locally. The ranks exchange what a step
noted at the next training forward, before it runs (one small all-gather, where every rank is
anyway, as DDP's own start-up broadcast is): the backward and the first step run no collective
of ours, so a rank that fails there is blamed as before. The inputs are "the same" only when every rank's inputs *and* loss are equal: a script
that shares its inputs but gives each rank its own targets computes different losses. A fixed
batch may be a warm-up: rank 0 warns once, naming the fixes, only when ``STEPS`` steps in a row
were the same on every rank with no DataLoader. The first step that differs ends the check, and
so does the first forward a DataLoader feeds, at once and without a collective: every rank is in
that loop, and its next step may be in an uneven last round that some ranks never reach
(``even_batches=False``). Nothing per step after it.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.distributed as dist

from .._job.job import Job
from .._kernel.concern import ForwardCall
from .._kernel.session import Session
from .._warn import warn_user
from . import order as _data_order

STEPS = 2  # steps in a row on the same inputs before it is said: one warm-up step is not


def note_inputs(job: Job, call: ForwardCall, session: Session) -> None:
    """A training forward through an engine while the check runs: compare the last step's
    notes with the other ranks (the collective), then note this forward's inputs (local)."""
    adoption = job.adoption
    # one data-parallel rank (a tensor-parallel group, a pipeline): the same inputs by design
    if adoption.inputs_checked or job.coordinates.dp_size == 1 or not dist.is_initialized():
        return
    if adoption.unsent_inputs is not None:
        _compare(job, *adoption.unsent_inputs)
        if adoption.inputs_checked:
            return
    if session.active_loader() is not None:
        # a DataLoader feeds this step on every rank: the check ends here, with no collective
        # (the next step may be in an uneven last round some ranks have left: even_batches=False)
        adoption.inputs_checked = True
        adoption.pending_inputs = None
        return
    digest = zlib.crc32((adoption.pending_inputs or 0).to_bytes(4, "little"),
                        _data_order.fingerprint((call.args, call.kwargs)))
    adoption.pending_inputs = digest


def note_loss(job: Job, loss: torch.Tensor) -> None:
    """The backward of noted forwards: its loss joins their notes, compared at the next step."""
    adoption = job.adoption
    digest = adoption.pending_inputs or 0
    adoption.pending_inputs = None
    local = loss.to_local() if hasattr(loss, "to_local") else loss  # a DTensor (loss_parallel)
    value = float(local.detach().double().sum())  # a sync, for the first few steps only
    bits = int(torch.tensor([value], dtype=torch.float64).view(torch.int64).item())
    adoption.unsent_inputs = (digest, bits)


def _compare(job: Job, digest: int, bits: int) -> None:
    adoption = job.adoption
    adoption.unsent_inputs = None
    mine = torch.tensor([digest, bits], dtype=torch.int64,
                        device=job.comm_device(torch.device("cpu")))
    everyone = [torch.empty_like(mine) for _ in range(job.world_size)]
    dist.all_gather(everyone, mine)
    rows = [[int(v) for v in t.cpu().tolist()] for t in everyone]
    losses = [torch.tensor([r[1]], dtype=torch.int64).view(torch.float64).item() for r in rows]
    # every rank reads the same rows: they agree on whether the check goes on (its collective)
    same = (len({r[0] for r in rows}) == 1
            and all(math.isclose(x, losses[0], rel_tol=1e-6, abs_tol=1e-12)
                    or (math.isnan(x) and math.isnan(losses[0])) for x in losses))
    adoption.same_inputs = adoption.same_inputs + 1 if same else 0
    if not same or adoption.same_inputs >= STEPS:
        adoption.inputs_checked = True
    if same and adoption.same_inputs >= STEPS and job.rank == 0:
        world = job.world_size
        warn_user(
            f"every one of the {world} ranks trained its first {STEPS} steps on the same "
            "inputs and targets, which came from no DataLoader that accel_ctx shards (batches "
            f"made by the script itself): the {world} processes train {world} identical "
            f"copies of the model at {world} times the cost of one. Give each rank its own "
            "part of the data: iterate a DataLoader inside distributed() (each rank then gets "
            "its share), take this rank's part with split_between_processes(data), or select "
            "by rank (e.g. data[state().rank::state().world_size]); for batches drawn at "
            "random, seed each rank differently (torch.manual_seed(seed + state().rank)).",
            RuntimeWarning)
