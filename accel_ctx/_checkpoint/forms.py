"""Where an engine keeps a model's or an optimizer's state in its own form (DeepSpeed's
partitions), the form it reads and writes it in, asked through the concern protocol; and the
parameter groups of an optimizer as the script made them (an engine may have re-pointed them)."""

from __future__ import annotations

import contextvars
from typing import Any

import torch

from .._kernel import state as _state
from .._kernel.checkpoint_form import CheckpointForm

# The scopes' stack while a checkpoint calls torch as stock torch (``dcp.as_stock_torch``,
# which hides the stack from torch's patched entry points, not from the checkpoint itself).
OUTER: contextvars.ContextVar[_state.Stack | None] = contextvars.ContextVar(
    "accel_ctx_checkpoint_outer", default=None)


def engine_form(obj: Any) -> CheckpointForm | None:
    """The engine's form of ``obj``'s state, or None: DCP reads and writes it as it is."""
    stack = _state.current() or OUTER.get()
    for concern in stack.concerns if stack is not None else ():
        form = concern.checkpoint_form(obj)
        if form is not None:
            return form
    return None


def param_groups(optimizer: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
    """``optimizer``'s parameters per group, as the script gave them."""
    form = engine_form(optimizer)
    if form is not None:
        return form.groups()
    return [list(group["params"]) for group in optimizer.param_groups]
