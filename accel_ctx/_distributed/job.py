"""The job a ``distributed()`` entry formed, and what a data-parallel engine adopted in it.

A :class:`Job` is plain data: where this process stands (global rank and world, and its
data-parallel coordinates, which tensor parallelism will make differ from the global ones), its
device and backend, the options of the entry, and the rank's published progress. Everything
below the scopes (data sharding, collectives, barriers, blame) reads the job and nothing else of
``distributed()``. A nested ``distributed()`` makes a job of its own (its options may differ)
whose ``root`` is the outermost one: the process group, the progress and the adoption record
belong to the root.

An :class:`Adoption` is the engine-neutral record of the modules a job's engine took over (moved
to the device, engine attached, parameters replaced): the DDP engine (``_engines.replicate``) writes it,
and a second engine (FSDP2) reuses it.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import ConfigurationError
from . import env as _env
from .heartbeat import Heartbeat
from .options import DistributedOptions
from .progress import Progress

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


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
        self.coordinates = launch.coordinates  # the launch environment's, not a copy
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

    @property
    def rank(self) -> int:
        return self.coordinates.rank

    @property
    def world_size(self) -> int:
        return self.coordinates.world_size

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


# Jobs formed in this process and still open, in any thread (outermost first). Rank and world
# are facts of the process: a thread started inside distributed() has no scope of its own, but
# its @on_main_process, main_print and state() must see the process's real coordinates.
_process_jobs: list[Job] = []
_jobs_lock = threading.Lock()


def process_job() -> Job | None:
    """The job this process is in now (the latest one still open), whichever thread formed it."""
    jobs = _process_jobs
    return jobs[-1] if jobs else None


def open_process_job(job: Job) -> None:
    with _jobs_lock:
        _process_jobs.append(job)


def close_process_job(job: Job) -> None:
    with _jobs_lock:
        if job in _process_jobs:
            _process_jobs.remove(job)
