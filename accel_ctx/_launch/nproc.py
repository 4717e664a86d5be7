"""How many processes one machine starts: ``auto``, and the limit on absurd counts.

Shared by ``launch(fn, nprocs)`` and ``accel-ctx launch -n``. Standard library only; torch is
imported when ``auto`` counts the GPUs.

Examples:
    >>> from accel_ctx._launch.nproc import process_limit
    >>> process_limit({"ACCEL_CTX_MAX_NPROC": "8"})
    8
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..errors import ConfigurationError

MAX_NPROC_VAR = "ACCEL_CTX_MAX_NPROC"
TORCHRUN_NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")
"""Values of torchrun's --nproc-per-node that let torchrun count the devices itself."""


def local_gpus() -> int:
    """CUDA devices on this machine (0 without CUDA); cheap: it does not initialise CUDA."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def process_limit(environ: Mapping[str, str]) -> int:
    """The most processes one machine may start: ``ACCEL_CTX_MAX_NPROC``, else
    max(64, 4 x CPU cores). A sane job runs one per GPU or a few per core; far more than
    this only thrashes the machine or waits for minutes on a rendezvous that cannot form."""
    raw = environ.get(MAX_NPROC_VAR, "").strip()
    if raw:
        if not raw.isdigit() or int(raw) < 1:
            raise ConfigurationError(
                f"{MAX_NPROC_VAR}={raw!r}: give the most processes per machine, a number "
                "(1 or more), or unset it."
            )
        return int(raw)
    return max(64, 4 * (os.cpu_count() or 1))


def check_process_count(count: int, what: str, environ: Mapping[str, str]) -> None:
    """Refuse a number of local processes no machine runs (``-n 1000000``), before starting any."""
    limit = process_limit(environ)
    if count > limit:
        why = (f"the limit set by {MAX_NPROC_VAR}" if environ.get(MAX_NPROC_VAR, "").strip()
               else f"max(64, 4 x {os.cpu_count() or 1} CPU cores)")
        raise ConfigurationError(
            f"{what} asks for {count} processes on this machine, more than it can run "
            f"(at most {limit}: {why}). Give fewer: usually one per GPU, or a few per CPU "
            f"core; with several machines, -n counts per machine and --nnodes counts machines. "
            f"If you really mean {count}, set {MAX_NPROC_VAR}={count}."
        )


def check_torchrun_nproc(value: str, environ: Mapping[str, str]) -> None:
    """Check torchrun's own ``--nproc-per-node`` when the user gives it instead of ``-n``."""
    if value in TORCHRUN_NPROC_WORDS:
        return  # torchrun counts the devices or cores itself
    if not value.strip().isdigit() or int(value) < 1:
        raise ConfigurationError(
            f"--nproc-per-node {value!r} is not valid: give a number of processes per node "
            f"(1 or more) or one of {', '.join(TORCHRUN_NPROC_WORDS)}."
        )
    check_process_count(int(value), f"--nproc-per-node {value}", environ)
