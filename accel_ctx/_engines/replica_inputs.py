"""Scripts without a DataLoader: every rank fed the same batch trains the same replica.

nanoGPT's ``get_batch`` and the word language model's ``batchify`` make their batches
themselves; wrapped as they are, every rank trains on the same tensors unless the script
slices them by rank, so W processes train W identical copies at W times the cost of one. When
a data-parallel engine trains for the first time in a job, the ranks exchange a fingerprint of
that forward's inputs once (one small all-gather beside DDP's own start-up broadcast; nothing
per step) and, if no DataLoader accel_ctx shards fed it and every rank's inputs are equal, rank
0 warns once, naming the fixes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._core.concern import ForwardCall
from .._core.session import Session
from .._data import order as _data_order
from .._distributed.job import Job
from .._warn import warn_user


def check_first_inputs(job: Job, call: ForwardCall, session: Session) -> None:
    """At the job's first training forward through an engine: warn if every rank got the same
    inputs from outside any sharded loader."""
    adoption = job.adoption
    if adoption.inputs_checked or job.world_size == 1 or not dist.is_initialized():
        return
    adoption.inputs_checked = True
    fed = session.active_loader() is not None
    digest = _data_order.fingerprint((call.args, call.kwargs))
    mine = torch.tensor([int(fed), digest], dtype=torch.int64,
                        device=job.comm_device(torch.device("cpu")))
    everyone = [torch.empty_like(mine) for _ in range(job.world_size)]
    dist.all_gather(everyone, mine)
    rows = [tuple(int(v) for v in t.cpu().tolist()) for t in everyone]
    if job.rank != 0 or any(fed_by_loader for fed_by_loader, _ in rows):
        return
    if len({d for _, d in rows}) == 1:
        world = job.world_size
        warn_user(
            f"every one of the {world} ranks trained its first step on the same inputs, which "
            "came from no DataLoader that accel_ctx shards (batches made by the script itself): "
            f"the {world} processes train {world} identical copies of the model at {world} "
            "times the cost of one. Give each rank its own part of the data: iterate a "
            "DataLoader inside distributed() (each rank then gets its share), take this rank's "
            "part with split_between_processes(data), or select by rank (e.g. "
            "data[state().rank::state().world_size]); for batches drawn at random, seed each "
            "rank differently (torch.manual_seed(seed + state().rank)).",
            RuntimeWarning)
