"""The form an engine keeps a model's or optimizer's state in, as checkpoints see it."""

from __future__ import annotations

from typing import Any, Protocol

import torch


class CheckpointForm(Protocol):
    """A model's or optimizer's state in the form an engine keeps it (DeepSpeed's partitions),
    as checkpoints read and write it: DCP's full form, whole tensors keyed by parameter name."""

    def groups(self) -> list[list[torch.Tensor]]:
        """An optimizer's parameters per group, as the script gave them (a model: none)."""
        ...

    def state(self) -> dict[str, Any]:
        """The state dict (collective: every rank, in the same order)."""
        ...

    def load(self, state: dict[str, Any]) -> None:
        """Put ``state`` back (collective)."""
        ...
