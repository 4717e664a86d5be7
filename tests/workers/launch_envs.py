"""Ranks started as srun or mpirun would start them: only their variables, no launcher."""

from __future__ import annotations

import os
import time
from typing import Any

from accel_ctx import distributed, state
from accel_ctx.errors import RendezvousError

from .common import params, train


def train_in_shapes(shapes: dict[str, list[dict[str, str]]], batch: int) -> dict[str, Any]:
    """For each launcher shape: set this rank's variables, train in distributed(), unset them."""
    index = int(os.environ["SHAPE_INDEX"])
    out: dict[str, Any] = {}
    for name, per_rank in shapes.items():
        variables = per_rank[index]
        os.environ.update(variables)
        try:
            with distributed():
                s = state()
                model = train("mlp", batch)
                out[name] = {"params": params(model), "rank": s.rank, "world": s.world_size,
                             "local_rank": s.local_rank, "backend": s.backend}
        finally:
            for key in variables:
                del os.environ[key]
    return out


def lonely_rank(variables: dict[str, str], timeout: float) -> dict[str, Any]:
    """Rank 0 of a job whose other ranks never come: distributed() must fail in time."""
    os.environ.update(variables)
    start = time.monotonic()
    try:
        with distributed(timeout=timeout):
            pass
    except RendezvousError as exc:
        return {"error": str(exc), "elapsed": time.monotonic() - start}
    return {"error": None, "elapsed": time.monotonic() - start}
