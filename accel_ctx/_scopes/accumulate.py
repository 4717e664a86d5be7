"""``accumulate(k)`` and ``no_sync()``: gradient accumulation with the plain loop (the scopes;
their runtimes, and what a micro-step does, in ``_steps/accumulation.py``)."""

from __future__ import annotations

from contextlib import ExitStack

from typing_extensions import override

from .._hooks.scope import Scope
from .._options import checked
from .._steps.accumulation import AccumulateRuntime, NoSyncRuntime
from ..errors import ConfigurationError


@checked
class accumulate(Scope):
    """Accumulate gradients over ``steps`` micro-batches with the loop left unchanged.

    Every ``loss.backward()`` is a micro-step: the loss is divided by the group size, DDP's
    gradient all-reduce runs only on each group's last micro-step, and ``opt.step()``,
    ``opt.zero_grad()``, ``clip_grad_norm_`` and LR-scheduler steps take effect only after it.
    The end of a DataLoader always closes a group (see the module notes for a short last
    group). ``state().sync_gradients`` tells whether the current micro-step is a boundary.

    Examples:
        >>> import torch
        >>> from accel_ctx import accumulate, state
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> with accumulate(2):
        ...     for x in torch.randn(4, 3, 2):
        ...         model(x).sum().backward()
        ...         opt.step(); opt.zero_grad()
        ...     print(state().step)
        2
    """


    def __init__(self, steps: int) -> None:
        super().__init__()
        if isinstance(steps, bool) or not isinstance(steps, int):
            raise ConfigurationError(
                f"accumulate(steps={steps!r}): give a whole number of micro-batches (int >= 1)."
            )
        if steps < 1:
            raise ConfigurationError(
                f"accumulate(steps={steps}): need at least 1 micro-batch per optimizer step."
            )
        self.steps = steps

    @override
    def _open(self, exits: ExitStack) -> AccumulateRuntime:
        runtime = AccumulateRuntime(self.steps)
        exits.callback(runtime.close)
        return runtime


@checked
class no_sync(Scope):
    """Skip the gradient all-reduce of backward passes whose forward ran inside the scope.

    For users who drive accumulation themselves, like DDP's ``no_sync()`` but for every
    adopted model at once. Gradients accumulate locally; the first backward after the scope
    synchronises the sum.

    Examples:
        >>> import torch
        >>> from accel_ctx import distributed, no_sync
        >>> with distributed():
        ...     model = torch.nn.Linear(2, 1)
        ...     with no_sync():
        ...         model(torch.randn(4, 2)).sum().backward()
        ...     model(torch.randn(4, 2)).sum().backward()
    """

    def __init__(self) -> None:  # its own, so that no_sync(2) names no_sync() in the error
        super().__init__()

    @override
    def _open(self, exits: ExitStack) -> NoSyncRuntime:
        runtime = NoSyncRuntime()
        exits.callback(runtime.close)
        return runtime
