"""Where a job runs, chosen as ``distributed()`` enters: this rank's device and the process
group's backend, from the options (``_job.options``), the launch environment and the machine.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
import torch.distributed as dist

from ..errors import ConfigurationError, LaunchEnvironmentError
from . import env as _env
from .options import DistributedOptions

DEVICE_VARIABLE = "ACCEL_CTX_DEVICE"


# ---- device ------------------------------------------------------------------------------------
_PER_TASK_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


def gpu_sharing_problem(local_world_size: int, device_count: int, env: Mapping[str, str]
                        ) -> str | None:
    """Why this node's ranks would share GPUs (NCCL's "Duplicate GPU detected"), or None.

    Each local rank takes ``cuda:LOCAL_RANK``: more processes than GPUs on the node cannot work,
    except one GPU per process made visible to each task on its own (``CUDA_VISIBLE_DEVICES``
    set per task by srun, mpirun wrappers, or by hand), where every process sees one device.
    """
    if local_world_size <= device_count:
        return None
    visible = next((env[v] for v in _PER_TASK_VARS if env.get(v, "").strip()), None)
    if device_count == 1 and visible is not None and len(visible.split(",")) == 1:
        return None  # one device per task: each process sees its own GPU as device 0
    gpus = f"{device_count} GPU" + ("" if device_count == 1 else "s")
    return (
        f"{local_world_size} processes on this node but {gpus} visible to each: ranks would "
        "share a GPU, which NCCL refuses (\"Duplicate GPU detected\"). Start at most "
        f"{device_count} process{'' if device_count == 1 else 'es'} per node "
        f"(accel-ctx launch -n {device_count}), give each task its own GPU "
        "(CUDA_VISIBLE_DEVICES per task), or pass distributed(device='cpu')."
    )


def _check_available(device: torch.device) -> None:
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch build has no CUDA" if torch.version.cuda is None
                   else "no CUDA GPU is visible (torch.cuda.is_available() is False)")
            raise ConfigurationError(
                f"distributed(device={str(device)!r}): {why}. Pass device='cpu', or leave "
                "device=None to pick the best device this machine has."
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ConfigurationError(
                f"distributed(device={str(device)!r}): this process sees {count} GPU(s) "
                f"(cuda:0 to cuda:{count - 1}). Pick one of those, or leave device=None."
            )
        return
    module = getattr(torch, device.type, None) if device.type not in ("cpu", "meta") else None
    available = getattr(module, "is_available", None)
    if device.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        available = mps.is_available if mps is not None else None
    if callable(available) and not available():
        raise ConfigurationError(
            f"distributed(device={str(device)!r}): no {device.type} device is available here. "
            "Pass device='cpu', or leave device=None to pick the best device this machine has."
        )


def pick_device(options: DistributedOptions, launch: _env.LaunchEnv,
                env: Mapping[str, str] | None = None) -> torch.device:
    """This rank's device: the one asked for, else cuda:LOCAL_RANK, else mps, else cpu.

    Asked for by ``distributed(device=...)``, else by the environment variable
    ``ACCEL_CTX_DEVICE`` (e.g. ``cpu`` to keep a run, or a test suite, off the GPUs).
    """
    env = os.environ if env is None else env
    named = options.device if options.device is not None else _device_setting(env)
    asked = torch.device(named) if named is not None else None
    if asked is not None:
        _check_available(asked)
        if not (asked.type == "cuda" and asked.index is None):
            return asked
    elif not torch.cuda.is_available():
        mps = getattr(torch.backends, "mps", None)
        if launch.coordinates.world_size == 1 and mps is not None and mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if launch.is_distributed:
        problem = gpu_sharing_problem(launch.coordinates.local_world_size, count, env)
        if problem is not None:
            raise ConfigurationError(f"rank {launch.coordinates.rank} of {launch.coordinates.world_size}: {problem}")
    if count == 1:  # one GPU per process (CUDA_VISIBLE_DEVICES / srun --gpus-per-task)
        return torch.device("cuda", 0)
    if launch.coordinates.local_rank >= count:
        raise LaunchEnvironmentError(
            f"local rank {launch.coordinates.local_rank} has no GPU of its own: this node has {count}. "
            f"Start at most {count} processes per node, or pass distributed(device='cpu')."
        )
    return torch.device("cuda", launch.coordinates.local_rank)


def _device_setting(env: Mapping[str, str]) -> str | None:
    value = env.get(DEVICE_VARIABLE, "").strip()
    if not value:
        return None
    try:
        return str(torch.device(value))
    except (RuntimeError, ValueError):
        raise ConfigurationError(
            f"{DEVICE_VARIABLE}={value!r} is not a device: set it to 'cpu', 'cuda', 'cuda:1' or "
            "'mps', or unset it to pick the best device."
        ) from None


# ---- backend -----------------------------------------------------------------------------------
def pick_backend(options: DistributedOptions, device: torch.device) -> str:
    if options.backend is not None:
        return options.backend
    # NCCL for CUDA tensors, gloo beside it so CPU tensors (objects, RNG states) work too.
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def check_backend(backend: str, device: torch.device) -> None:
    """The backend exists in this build and can move tensors of ``device``."""
    names = [part.split(":")[-1] for part in backend.split(",")]
    available = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(),
                 "mpi": dist.is_mpi_available()}
    for name in names:
        if not available.get(name, True):
            usable = [n for n, ok in available.items() if ok]
            raise ConfigurationError(
                f"distributed(backend={backend!r}): this torch build has no {name} backend "
                f"(available: {', '.join(usable) or 'none'}). Leave backend=None to pick one "
                "that works on the device, or install a torch build with it."
            )
    if backend == "nccl" and device.type != "cuda":
        raise ConfigurationError(
            f"distributed(backend='nccl') with device {str(device)!r}: NCCL only moves CUDA "
            "tensors. Use backend='gloo' (or None) on this device, or run on GPUs."
        )
