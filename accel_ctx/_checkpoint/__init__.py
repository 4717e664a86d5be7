"""The checkpoint wing: ``save_state`` / ``load_state`` / ``save_model`` and what they stand on.

It sits above the core (it reads ``_kernel.state``, ``_data.iterate``, ``_group.blame``, ``errors``) and nothing in
the core imports it; ``accel_ctx`` loads it on first use of one of its names, so
``import accel_ctx`` never pays for ``torch.distributed.checkpoint``. Its modules, each
importing only those listed after it:

- ``save``: ``save_state``; ``load``: ``load_state`` and the ``Resumed`` it returns
- ``model``: ``save_model``, one file of weights for inference
- ``state``: what accel_ctx owns (counters, loss scale, loader positions); ``rng``: RNG states
- ``find``: which checkpoint a load takes, the newest complete and intact one
- ``dcp``: models and optimizers through ``torch.distributed.checkpoint``, the ranks' agreement
- ``guard``: every rank arrives, one save per folder, a full disk called a full disk
- ``files``: the folder layout and the atomic publish; ``sums``: CRC-32 of every file
"""

from __future__ import annotations

from .load import Resumed, load_state
from .model import save_model
from .save import save_state

__all__ = ["Resumed", "load_state", "save_model", "save_state"]
