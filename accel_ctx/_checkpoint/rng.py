"""The random number generators a training step may draw from, captured and restored.

Python's ``random``, NumPy's legacy global generator (only when the program imported
``numpy.random``: capturing it must not import it), torch's CPU generator and the
accelerator's generators.
States are kept as tensors, ints and tuples only, so a checkpoint holding them loads with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch


def capture() -> dict[str, Any]:
    """This process's generator states."""
    states: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    np = sys.modules.get("numpy")
    if np is not None and "numpy.random" in sys.modules:  # else its generator was never used
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        # an int64 tensor instead of the uint32 array: ndarrays need pickle to load
        states["numpy"] = (str(kind), torch.from_numpy(keys.astype("int64")), int(pos),
                           int(has_gauss), float(cached))
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        states["cuda"] = torch.cuda.get_rng_state_all()
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        states["mps"] = torch.mps.get_rng_state()
    return states


def restore(states: dict[str, Any]) -> None:
    """Put back what :func:`capture` saw; generators this process lacks are left alone."""
    random.setstate(_as_python_state(states["python"]))
    torch.set_rng_state(states["torch"])
    if "numpy" in states:
        try:
            import numpy as np
        except ImportError:  # saved where NumPy was used, resumed where it is not installed
            pass
        else:
            kind, keys, pos, has_gauss, cached = states["numpy"]
            np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    cuda = states.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    mps = getattr(torch.backends, "mps", None)
    if "mps" in states and mps is not None and mps.is_available():
        torch.mps.set_rng_state(states["mps"])


def _as_python_state(state: Any) -> tuple[Any, ...]:
    # random.setstate wants tuples; a round trip through some formats turns them into lists
    version, internal, gauss = state
    return (int(version), tuple(int(v) for v in internal), gauss)
