"""``accel-ctx env``: versions, devices, launch environment and config, for a bug report."""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Sequence
from typing import Any

from .._job import env as _env
from ..errors import AccelCtxError
from . import config as _config

_SHOWN_VARIABLES = (
    "ACCEL_CTX_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
    "CUDA_VISIBLE_DEVICES", "NCCL_", "GLOO_", "OMP_NUM_THREADS", "TORCHELASTIC_",
    "SLURM_JOB_ID", "SLURM_STEP_", "SLURM_PROCID", "SLURM_NTASKS", "OMPI_COMM_WORLD_", "PMI_",
)


def report(version: str) -> str:
    """The report as text: one ``name: value`` line each, ready to paste.

    ``version`` is accel_ctx's (the caller reads it: this wing never imports the package root).
    """
    import torch
    import torch.distributed as dist

    lines = [
        f"accel_ctx: {version}",
        f"python: {sys.version.split()[0]} ({platform.platform()})",
        f"torch: {torch.__version__}",
        f"CUDA (torch built with): {torch.version.cuda or 'none'}",
    ]
    cuda = torch.cuda.is_available()
    if cuda:
        untyped: Any = torch  # cudnn.version and nccl.version carry no annotations
        lines.append(f"cuDNN: {untyped.backends.cudnn.version()}")
        try:
            nccl = ".".join(str(v) for v in untyped.cuda.nccl.version())
        except (AttributeError, RuntimeError, TypeError):
            nccl = "unavailable"
        lines.append(f"NCCL: {nccl}")
    backends = [b for b in ("gloo", "nccl", "mpi") if getattr(dist, f"is_{b}_available", bool)()]
    lines.append(f"distributed backends: {', '.join(backends) or 'none'}")
    lines.append(f"CPU cores: {os.cpu_count()}")
    if cuda:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"cuda:{i}: {p.name}, {p.total_memory / 2**30:.1f} GiB, "
                         f"capability {p.major}.{p.minor}")
    else:
        lines.append("cuda: not available")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        lines.append("mps: available")
    try:
        launch = _env.detect()
        lines.append(
            f"launch environment: {launch.source}, rank {launch.coordinates.rank} of {launch.coordinates.world_size}"
            f" (local {launch.coordinates.local_rank} of {launch.coordinates.local_world_size}, node "
            f"{launch.coordinates.node_rank} of {launch.coordinates.num_nodes})"
        )
    except AccelCtxError as exc:
        lines.append(f"launch environment: invalid: {exc}")
    variables = sorted(k for k in os.environ if k.startswith(_SHOWN_VARIABLES))
    lines += ["environment:", *(f"  {k}={os.environ[k]}" for k in variables)] if variables else []
    try:
        config = _config.show(_config.load())
    except AccelCtxError as exc:
        config = f"invalid: {exc}\n"
    lines.append("config:")
    lines += [f"  {line}" for line in config.splitlines()]
    return "\n".join(lines) + "\n"


def env_main(argv: Sequence[str], version: str) -> int:
    """Run ``accel-ctx env``; ``version`` is accel_ctx's."""
    if argv and argv[0] in ("-h", "--help"):
        print("usage: accel-ctx env\n\nPrints accel_ctx, torch, CUDA and NCCL versions, the "
              "devices, the launch environment and the launcher config in force.")
        return 0
    if argv:
        print(f"accel-ctx env: takes no arguments (got {' '.join(argv)}).", file=sys.stderr)
        return 2
    print(report(version), end="")
    return 0
