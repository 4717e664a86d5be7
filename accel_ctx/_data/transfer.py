"""Moving batches to the device without stalling the step.

Pinned batches (``DataLoader(pin_memory=True)``) are copied with ``non_blocking=True`` on a side
CUDA stream: the copy of the next batch runs while the GPU is still busy with the current
step, and the step's stream waits for it on the GPU (an event), never on the host. Tensors
made on the side stream are recorded on the compute stream, so the caching allocator keeps
them until the step is done with them. Anything else is moved as ``tensor.to(device)`` does.
"""

from __future__ import annotations

from typing import Any

import torch

from .._kernel.tree import iter_tensors, to_device


class BatchMover:
    """Moves the batches of one loader iteration to ``device``.

    Examples:
        >>> import torch
        >>> from accel_ctx._data.transfer import BatchMover
        >>> BatchMover(torch.device("cpu"), pinned=False)({"x": torch.ones(2)})["x"].device
        device(type='cpu')
    """

    def __init__(self, device: torch.device, pinned: bool) -> None:
        self.device = device
        self.non_blocking = pinned and device.type == "cuda"
        self._stream: Any = None  # the side stream, made at the first batch

    def __call__(self, batch: Any) -> Any:
        if not self.non_blocking or not torch.cuda.is_available():
            return to_device(batch, self.device, self.non_blocking)
        compute = torch.cuda.current_stream(self.device)
        if self._stream is None:
            make: Any = torch.cuda.Stream
            self._stream = make(self.device)
        side = self._stream
        with torch.cuda.stream(side):
            moved = to_device(batch, self.device, non_blocking=True)
        compute.wait_stream(side)  # on the GPU: the host goes on at once
        for tensor in iter_tensors(moved):
            if tensor.device.type == "cuda":
                tensor.record_stream(compute)
        return moved
