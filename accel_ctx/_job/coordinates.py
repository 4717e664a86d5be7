"""Where a process stands in a job: declared once, read by the launch environment, the job and
``state()`` alike. No torch: the launcher reads it too.

Examples:
    >>> from accel_ctx._job.coordinates import Coordinates
    >>> where = Coordinates.of(rank=3, world_size=4, local_rank=1, local_world_size=2)
    >>> where.node_rank, where.num_nodes, where.dp_rank, where.dp_size
    (1, 2, 3, 4)
    >>> split = where.with_tensor_parallel(2)  # tp innermost: consecutive ranks form a TP group
    >>> split.dp_rank, split.dp_size, split.tp_rank, split.tp_size
    (1, 2, 1, 2)
    >>> where.with_sequence_parallel(2).sp_rank, where.with_sequence_parallel(4).sharers
    (1, 4)
    >>> where.with_pipeline_parallel(2).pp_rank, where.with_pipeline_parallel(2).dp_size
    (1, 2)
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace


@dataclass(frozen=True, slots=True)
class Coordinates:
    """Where this process stands: in the job, on its machine, and among data-parallel ranks."""

    rank: int = 0
    """This process's index in the job."""
    world_size: int = 1
    """Processes in the job."""
    local_rank: int = 0
    """Index among the processes on this machine."""
    local_world_size: int = 1
    """Processes on this machine."""
    node_rank: int = 0
    """Index of this machine."""
    num_nodes: int = 1
    """Machines in the job."""
    dp_rank: int = 0
    """Index among the ranks that split the data: ``rank // tp_size`` (or ``// sp_size``; the
    rank itself without tensor or sequence parallelism)."""
    dp_size: int = 1
    """Ranks that split the data: ``world_size // tp_size``."""
    tp_rank: int = 0
    """Index in this rank's tensor-parallel group (``rank % tp_size``: the group is consecutive
    ranks)."""
    tp_size: int = 1
    """Ranks that split each layer's weights (``tp=`` of ``sharded()``/``distributed()``)."""
    sp_rank: int = 0
    """Which slice of each sequence this rank holds (``rank % sp_size``: consecutive ranks)."""
    sp_size: int = 1
    """Ranks that split each sequence (``sp=`` of ``sharded()``/``distributed()``)."""
    pp_rank: int = 0
    """Which pipeline stage this rank runs (``rank % pp_size``: a pipeline is consecutive ranks)."""
    pp_size: int = 1
    """Pipeline stages each model is cut into (``pp=`` of ``distributed()``)."""

    @property
    def sharers(self) -> int:
        """Ranks that work on one batch (a tensor- or sequence-parallel group): one counts it."""
        return self.world_size // self.dp_size

    def as_dict(self) -> dict[str, int]:
        """The fields by name (what ``state()`` shows of them)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def with_tensor_parallel(self, tp: int) -> Coordinates:
        """These coordinates with tensor-parallel groups of ``tp`` consecutive ranks (tp is the
        innermost mesh dimension, as torchtitan lays it out): the data splits over the groups.
        ``tp`` must divide the world size (checked by the caller, who can name the fix)."""
        return replace(self, dp_rank=self.rank // tp, dp_size=self.world_size // tp,
                       tp_rank=self.rank % tp, tp_size=tp)

    def with_sequence_parallel(self, sp: int) -> Coordinates:
        """These coordinates with sequence-parallel groups of ``sp`` consecutive ranks: each
        holds a slice of every sequence of its group's batches (``sp`` divides the world)."""
        return replace(self, dp_rank=self.rank // sp, dp_size=self.world_size // sp,
                       sp_rank=self.rank % sp, sp_size=sp)

    def with_pipeline_parallel(self, pp: int) -> Coordinates:
        """These coordinates with pipelines of ``pp`` consecutive ranks: each runs one stage of
        every model on its pipeline's batches (``pp`` divides the world)."""
        return replace(self, dp_rank=self.rank // pp, dp_size=self.world_size // pp,
                       pp_rank=self.rank % pp, pp_size=pp)

    @classmethod
    def of(cls, rank: int = 0, world_size: int = 1, local_rank: int | None = None,
           local_world_size: int | None = None, node_rank: int | None = None,
           num_nodes: int | None = None) -> Coordinates:
        """Coordinates from what a launcher says; the rest follows from a block layout (ranks
        filled node by node) and data parallelism over the whole job."""
        per_node = max(local_world_size or world_size, 1)
        return cls(
            rank=rank,
            world_size=world_size,
            local_rank=local_rank if local_rank is not None else rank % per_node,
            local_world_size=per_node,
            node_rank=node_rank if node_rank is not None else rank // per_node,
            num_nodes=num_nodes if num_nodes is not None else max(1, -(-world_size // per_node)),
            dp_rank=rank,
            dp_size=world_size,
        )


SINGLE = Coordinates()
"""A single process: outside ``distributed()``."""
