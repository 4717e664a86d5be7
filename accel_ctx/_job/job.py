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
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import ConfigurationError
from . import env as _env
from .coordinates import Coordinates
from .heartbeat import Heartbeat
from .options import DistributedOptions
from .progress import Progress
from .sequence import SequenceShare

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
        "pending_inputs",
        "replaced",
        "same_inputs",
        "undo_batchnorm",
        "uneven_tail",
        "unsent_inputs",
        "warned_batchnorm",
    )

    def __init__(self) -> None:
        self.modules: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        # parameters a device move replaced (meta, XLA, ...): id(old) -> (old, new); optimizers
        # made before the move are pointed at the new ones when accel_ctx first meets them
        # (None: the parameter left this rank, held by another pipeline stage)
        self.replaced: dict[int, tuple[weakref.ref[nn.Parameter], nn.Parameter | None]] = {}
        self.parts_checked: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self.undo_batchnorm: list[tuple[nn.Module, str, nn.Module]] = []
        self.warned_batchnorm = False
        # engine forwards with gradients so far (numbers them for _join), and the refusal a
        # forward gets in an uneven last round that no Join covers (even_batches=False)
        self.forwards = 0
        self.uneven_tail: str | None = None
        # the ranks compared their first training inputs (_replica_inputs): done, the steps
        # in a row that were the same on every rank, and this step's forwards, not yet compared
        self.inputs_checked = False
        self.same_inputs = 0
        self.pending_inputs: int | None = None  # the digest of this step's inputs
        self.unsent_inputs: tuple[int, int] | None = None  # a step's (digest, loss bits)


class Job:
    """Where this process stands in the job, and how the job was set up."""

    def __init__(
        self,
        launch: _env.LaunchEnv,
        device: torch.device,
        backend: str | None,
        options: DistributedOptions,
        root: Job | None = None,
        outer: Job | None = None,
    ) -> None:
        self.launch = launch
        self.device = device
        self.backend = backend
        self.options = options
        self.root: Job = root if root is not None else self
        # the launch environment's, split into ("dp", "tp") when tensor parallelism is asked
        # for (a nested scope that does not ask keeps the outer job's split)
        tp = options.tp if options.tp is not None else (
            outer.coordinates.tp_size if outer is not None else 1)
        given = options.sp if options.sp is not None else options.cp
        sp = given if given is not None else (
            outer.coordinates.sp_size if outer is not None else 1)
        pp = options.pp if options.pp is not None else (
            outer.coordinates.pp_size if outer is not None else 1)
        self.coordinates: Coordinates = (_split(launch.coordinates, tp) if tp > 1
                                         else _split(launch.coordinates, sp, "sp") if sp > 1
                                         else _split(launch.coordinates, pp, "pp") if pp > 1
                                         else launch.coordinates)
        # pp: the micro-batches a batch is cut into (a nested scope keeps the outer job's)
        self.microbatches: int = options.microbatches or (
            outer.microbatches if outer is not None else 1)
        # sp: what the loader's split made of the current batch (one record for the job)
        self.sequence: SequenceShare | None = (
            None if sp == 1 else root.sequence if root is not None and root.sequence is not None
            else SequenceShare(sp, self.coordinates.sp_rank, ring=(options.cp or 1) > 1))
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
        self.waits = 0  # wait_for_everyone() calls: results may meet through files (_eval_passes)
        self.no_grad_forwards = 0  # top-level forwards without gradients (evaluations)
        self._meshes: dict[tuple[str, int], DeviceMesh] = {}
        # run as the outermost distributed() exits, while the group and engines are there (a
        # resumable() entered outside it writes its final checkpoint): each gets the exception
        self.at_end: list[Callable[[BaseException | None], None]] = []

    def end(self, exc_type: type[BaseException] | None, exc: BaseException | None,
            tb: object) -> bool:
        """The outermost ``distributed()`` exits: ``at_end``, the newest first."""
        while self.at_end:
            self.at_end.pop()(exc)
        return False

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
        """The job of a ``distributed()`` nested in this one's: same group, its own options
        (what it was not given, this job's)."""
        # sharded() inside distributed(timeout=60) waits 60 s, as the group it shares does
        own = {name: getattr(options, name) for name in options.given}
        merged = replace(self.options, **own, given=self.options.given | options.given)
        return Job(self.launch, self.device, self.backend, merged, self.root, self)

    def mesh_groups(self) -> list[Any]:
        """The process groups of the job's device meshes: the engines' own collectives."""
        return [g for mesh in self.root._meshes.values() for g in mesh.get_all_groups()]

    def _cached_mesh(self, key: tuple[str, int], shape: tuple[int, ...],
                     names: tuple[str, ...]) -> DeviceMesh:
        meshes = self.root._meshes  # one per layout for the job's process group
        mesh = meshes.get(key)
        if mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = meshes[key] = init_device_mesh(self.device.type, shape, mesh_dim_names=names)
            if len(names) > 1 and names[-1] == "tp":
                # a norm or sum over split and sharded parameters (clip_grad_norm_) reduces over
                # every dimension: with a flattened one DTensor does it in one all-reduce, not
                # one per dimension with torch's "suboptimal" warning (torchtitan flattens too)
                for dims in (names, names[1:]) if len(names) > 2 else (names,):
                    mesh[dims]._flatten()
            self._own_timeout(mesh)
        return mesh

    def _own_timeout(self, mesh: DeviceMesh) -> None:
        """The mesh's subgroups wait as long as the job's group: torch makes them with its
        default (30 minutes on gloo), and a stalled peer would hold the others that long."""
        import torch.distributed as dist

        set_timeout: Any = getattr(dist.distributed_c10d, "set_timeout", None) or getattr(
            dist.distributed_c10d, "_set_pg_timeout", None)  # public from torch 2.14
        if set_timeout is None:
            return
        world = dist.group.WORLD
        for group in mesh.get_all_groups():
            if group is not world and group.size() > 1:
                set_timeout(self.root.options.timeout, group)

    @property
    def mesh(self) -> DeviceMesh:
        """The data-parallel device mesh ``("dp",)``, built on first use: over the job, or the
        "dp" dimension of :attr:`tp_mesh` under tensor parallelism. Under sequence parallelism
        it spans every rank: the gradients average over the sequences' slices too."""
        if self.coordinates.tp_size > 1:
            return self.tp_mesh["dp"]
        if self.coordinates.pp_size > 1:
            return self.pp_mesh_2d["dp"]
        return self._cached_mesh(("dp", 1), (self.gradient_ranks,), ("dp",))

    @property
    def gradient_ranks(self) -> int:
        """The ranks a gradient averages over: the data-parallel ones, times sp."""
        return self.coordinates.dp_size * self.coordinates.sp_size

    @property
    def sp_mesh(self) -> DeviceMesh:
        """The 1-D mesh of this rank's sequence-parallel ranks (the "sp" dimension of a
        ("dp", "sp") mesh, built on first use)."""
        where = self.coordinates
        return self._cached_mesh(("dp,sp", where.sp_size), (where.dp_size, where.sp_size),
                                 ("dp", "sp"))["sp"]

    @property
    def pp_mesh_2d(self) -> DeviceMesh:
        """The 2-D mesh ``("dp", "pp")``: pipelines of consecutive ranks, data-parallel across
        them (the stage's DDP averages over "dp"); built on first use."""
        where = self.coordinates
        return self._cached_mesh(("dp,pp", where.pp_size), (where.dp_size, where.pp_size),
                                 ("dp", "pp"))

    @property
    def tp_mesh(self) -> DeviceMesh:
        """The 2-D mesh ``("dp", "tp")``: tensor-parallel groups of consecutive ranks (tp
        innermost), data-parallel across them; built on first use."""
        where = self.coordinates
        return self._cached_mesh(("dp,tp", where.tp_size), (where.dp_size, where.tp_size),
                                 ("dp", "tp"))

    def copy_size(self, shard_size: int | None, hybrid: bool) -> int | None:
        """The data-parallel ranks one copy of a sharded model spans (None: all of them);
        ``hybrid``: those of one machine (its processes over each tensor-parallel group's)."""
        where = self.coordinates
        return shard_size or (where.local_world_size // where.tp_size if hybrid else None)

    def tp_mesh_for(self, shard_size: int | None) -> DeviceMesh:
        """The mesh a split model lives on: :attr:`tp_mesh`, or with HSDP (copies of
        ``shard_size`` data-parallel ranks each) ``("replicate", "shard", "tp")``: one root mesh
        for the split and the sharding, as FSDP2 requires of a split parameter."""
        where = self.coordinates
        if shard_size is None or shard_size == where.dp_size:
            return self.tp_mesh
        self._check_shard_size(shard_size)
        if shard_size == 1:  # torch's FSDP2 over a "shard" dimension of one rank fails under TP
            raise ConfigurationError(
                f"sharded(tp={where.tp_size}, shard_size=1): copies of one data-parallel rank "
                "each (nothing sharded) are not supported with tensor parallelism. Give "
                f"shard_size >= 2 (a divisor of the {where.dp_size} data-parallel ranks), or drop "
                "shard_size to shard over all of them.")
        return self._cached_mesh(
            ("replicate,shard,tp", shard_size),
            (where.dp_size // shard_size, shard_size, where.tp_size), ("replicate", "shard", "tp"))

    def sharding_mesh(self, shard_size: int | None) -> DeviceMesh:
        """The mesh a sharded model lives on: ``("dp",)`` when one copy is sharded over every
        data-parallel rank, else ``("replicate", "shard")``: copies of ``shard_size`` ranks each
        (HSDP; under tensor parallelism the first two dimensions of :meth:`tp_mesh_for`), built
        on first use."""
        size = self.gradient_ranks
        if shard_size is None or shard_size == size:
            return self.mesh
        if self.coordinates.tp_size > 1:
            return self.tp_mesh_for(shard_size)["replicate", "shard"]
        self._check_shard_size(shard_size)
        return self._cached_mesh(("hsdp", shard_size), (size // shard_size, shard_size),
                                 ("replicate", "shard"))

    def _check_shard_size(self, shard_size: int) -> None:
        size = self.coordinates.dp_size
        if shard_size < 1 or size % shard_size:
            raise ConfigurationError(
                f"sharded(shard_size={shard_size}): the {size} data-parallel ranks cannot be "
                f"split into groups of {shard_size}; give a divisor of {size}.")


def _split(where: Coordinates, tp: int, name: str = "tp") -> Coordinates:
    """``where`` with tensor- (or sequence-) parallel groups of ``tp``; refused when they
    cannot be formed."""
    if where.world_size % tp:
        fits = [n for n in range(1, where.world_size + 1) if where.world_size % n == 0]
        kind = {"tp": "tensor", "sp": "sequence"}.get(name, "pipeline")
        raise ConfigurationError(
            f"{name}={tp}: the {where.world_size} processes of this job cannot form {kind}-parallel "
            f"groups of {tp} ranks each. Start a multiple of {tp} processes "
            f"(accel-ctx launch -n {tp * max(1, where.world_size // tp)}), or give {name} a divisor "
            f"of {where.world_size} ({', '.join(map(str, fits))}).")
    if name == "pp":
        return where.with_pipeline_parallel(tp)
    return where.with_tensor_parallel(tp) if name == "tp" else where.with_sequence_parallel(tp)


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
