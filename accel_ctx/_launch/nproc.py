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


_FEWER = ("Give fewer: usually one per GPU, or a few per CPU core; with several machines, -n "
          "counts per machine and --nnodes counts machines.")


def check_process_count(count: int, what: str, environ: Mapping[str, str],
                        fix: str = _FEWER) -> None:
    """Refuse a number of local processes no machine runs (``-n 1000000``), before starting any;
    ``fix`` says what to give instead."""
    limit = process_limit(environ)
    if count > limit:
        why = (f"the limit set by {MAX_NPROC_VAR}" if environ.get(MAX_NPROC_VAR, "").strip()
               else f"max(64, 4 x {os.cpu_count() or 1} CPU cores)")
        raise ConfigurationError(
            f"{what} asks for {count} processes on this machine, more than it can run "
            f"(at most {limit}: {why}). {fix} If you really mean {count}, set "
            f"{MAX_NPROC_VAR}={count}."
        )


def group_limit(environ: Mapping[str, str]) -> int:
    """The most replica groups ``launch --replica-groups R`` starts on one machine: each is a
    launcher of its own (a Python with torch and torchrun's agent) besides its workers, so
    max(16, CPU cores), or ``ACCEL_CTX_MAX_NPROC`` where set.

    Examples:
        >>> from accel_ctx._launch.nproc import group_limit
        >>> group_limit({"ACCEL_CTX_MAX_NPROC": "200"}), group_limit({}) >= 16
        (200, True)
    """
    if environ.get(MAX_NPROC_VAR, "").strip():
        return process_limit(environ)
    return max(16, os.cpu_count() or 1)


def check_replica_groups(groups: int, nproc: int, environ: Mapping[str, str]) -> None:
    """Refuse ``--replica-groups R`` on one machine that no machine runs: more than
    :func:`group_limit` groups, or R x -n processes over :func:`process_limit` (the limit of
    ``-n`` alone), before starting any."""
    several = ("or run the groups on several machines (`accel-ctx lighthouse`, then `accel-ctx "
               "launch --lighthouse HOST:PORT --replica-group I` on each).")
    limit = group_limit(environ)
    if groups > limit:
        why = (f"the limit set by {MAX_NPROC_VAR}" if environ.get(MAX_NPROC_VAR, "").strip()
               else f"max(16, {os.cpu_count() or 1} CPU cores)")
        raise ConfigurationError(
            f"--replica-groups {groups} starts {groups} group launchers on this machine (each a "
            f"Python with torch and torchrun's agent, besides its workers), more than it runs "
            f"well (at most {limit}: {why}). Give fewer groups, {several} If you really mean "
            f"{groups}, set {MAX_NPROC_VAR}={groups * max(nproc, 1)}.")
    check_process_count(
        groups * nproc, f"--replica-groups {groups} with -n {nproc} ({groups} groups of {nproc})",
        environ, fix=f"Give fewer groups or fewer processes per group (-n), {several}")


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
