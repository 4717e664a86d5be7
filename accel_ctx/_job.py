"""The job a ``distributed()`` entry formed, and what a data-parallel engine adopted in it.

A :class:`Job` is plain data: where this process stands (global rank and world, and its
data-parallel coordinates, which tensor parallelism will make differ from the global ones), its
device and backend, the options of the entry, and the rank's published progress. Everything
below the scopes (data sharding, collectives, barriers, blame) reads the job and nothing else of
``distributed()``. A nested ``distributed()`` makes a job of its own (its options may differ)
whose ``root`` is the outermost one: the process group, the progress and the adoption record
belong to the root.

An :class:`Adoption` is the engine-neutral record of the modules a job's engine took over (moved
to the device, engine attached, parameters replaced): the DDP engine (``_replicate``) writes it,
and a second engine (FSDP2) reuses it.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from . import _env
from ._dist_options import DistributedOptions
from ._heartbeat import Heartbeat
from ._progress import Progress
from .errors import ConfigurationError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True, slots=True)
class Coordinates:
    """Where this process stands: in the job, on its machine, and among data-parallel ranks.

    Examples:
        >>> from accel_ctx._job import Coordinates
        >>> Coordinates().rank, Coordinates().world_size
        (0, 1)
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    dp_rank: int = 0
    """Index among the ranks that split the data (the whole job until tensor parallelism)."""
    dp_size: int = 1


SINGLE = Coordinates()
"""A single process: outside ``distributed()``."""


class Adoption:
    """The modules one job adopted, and what adopting them changed."""

    __slots__ = (
        "__weakref__",
        "forwards",
        "inputs_checked",
        "modules",
        "parts_checked",
        "replaced",
        "undo_batchnorm",
        "uneven_tail",
        "warned_batchnorm",
    )

    def __init__(self) -> None:
        self.modules: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        # parameters a device move replaced (meta, XLA, ...): id(old) -> (old, new); optimizers
        # made before the move are pointed at the new ones when accel_ctx first meets them
        self.replaced: dict[int, tuple[weakref.ref[nn.Parameter], nn.Parameter]] = {}
        self.parts_checked: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self.undo_batchnorm: list[tuple[nn.Module, str, nn.Module]] = []
        self.warned_batchnorm = False
        # engine forwards with gradients so far (numbers them for _join), and the refusal a
        # forward gets in an uneven last round that no Join covers (even_batches=False)
        self.forwards = 0
        self.uneven_tail: str | None = None
        # the ranks compared their first training inputs (_replica_inputs)
        self.inputs_checked = False


class Job:
    """Where this process stands in the job, and how the job was set up."""

    def __init__(
        self,
        launch: _env.LaunchEnv,
        device: torch.device,
        backend: str | None,
        options: DistributedOptions,
        root: Job | None = None,
    ) -> None:
        self.launch = launch
        self.device = device
        self.backend = backend
        self.options = options
        self.root: Job = root if root is not None else self
        self.rank = launch.rank
        self.world_size = launch.world_size
        # data-parallel coordinates: the whole world for now; tensor parallelism will split it
        self.coordinates = Coordinates(launch.rank, launch.world_size, launch.local_rank,
                                       launch.local_world_size, launch.rank, launch.world_size)
        self.debug = options.debug or os.environ.get(_env.DEBUG_VAR, "") not in ("", "0")
        # where this rank is (step, phase), for the other ranks' failure messages (_blame)
        self.progress: Progress = root.progress if root is not None else Progress()
        self.adoption: Adoption = root.adoption if root is not None else Adoption()
        self.heartbeat: Heartbeat | None = None
        # evaluation passes over sharded loaders (_eval_passes): the one awaiting its verdict,
        # the loaders already warned about, and gather_for_metrics calls so far
        self.pending_eval: Any = None
        self.eval_warned: weakref.WeakSet[Any] = weakref.WeakSet()
        self.metric_gathers = 0
        self.no_grad_forwards = 0  # top-level forwards without gradients (evaluations)
        self._mesh: DeviceMesh | None = None
        self._hybrid_meshes: dict[int, DeviceMesh] = {}

    def comm_device(self, device: torch.device) -> torch.device:
        """Where a tensor on ``device`` must be for the backend: NCCL cannot move CPU tensors."""
        if device.type == "cpu" and self.backend == "nccl":
            return self.device
        return device

    def nested(self, options: DistributedOptions) -> Job:
        """The job of a ``distributed()`` nested in this one's: same group, its own options."""
        return Job(self.launch, self.device, self.backend, options, self.root)

    @property
    def mesh(self) -> DeviceMesh:
        """A one-dimensional device mesh ``("dp",)`` over the job, built on first use."""
        root = self.root
        if root._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            size = (self.coordinates.dp_size,)
            root._mesh = init_device_mesh(self.device.type, size, mesh_dim_names=("dp",))
        return root._mesh

    def sharding_mesh(self, shard_size: int | None) -> DeviceMesh:
        """The mesh a sharded model lives on: ``("dp",)`` when one copy is sharded over every
        data-parallel rank, else ``("replicate", "shard")``: copies of ``shard_size`` ranks each
        (HSDP), built on first use."""
        size = self.coordinates.dp_size
        if shard_size is None or shard_size == size:
            return self.mesh
        if shard_size < 1 or size % shard_size:
            raise ConfigurationError(
                f"sharded(shard_size={shard_size}): the {size} data-parallel ranks cannot be "
                f"split into groups of {shard_size}; give a divisor of {size}.")
        root = self.root
        mesh = root._hybrid_meshes.get(shard_size)
        if mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(self.device.type, (size // shard_size, shard_size),
                                    mesh_dim_names=("replicate", "shard"))
            root._hybrid_meshes[shard_size] = mesh
        return mesh
