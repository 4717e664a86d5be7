"""``local_sgd(every=H)``: Local SGD, and DiLoCo with an outer optimizer (the scope; its runtime,
and what a synchronisation does, in ``_steps/local_sgd.py``)."""

from __future__ import annotations

from contextlib import ExitStack

import torch
from typing_extensions import override

from .._hooks.scope import Scope
from .._kernel import state as _state
from .._options import checked
from .._steps.local_sgd import LocalSGDRuntime, OuterOptimizer, refuse_parts
from .._steps.local_sgd_checks import check_outer_optimizer
from ..errors import ConfigurationError

__all__ = ["OuterOptimizer", "local_sgd"]


@checked
class local_sgd(Scope):
    """Local SGD: each rank steps on its own gradients; every ``every`` steps they synchronise.

    Inside ``distributed()``, backward passes skip DDP's gradient all-reduce and ``opt.step()``
    updates each rank's own copy of the model. After every ``every``-th optimizer step the
    parameters are averaged over the ranks (torch's ``PeriodicModelAverager``). With
    ``outer_optimizer`` it is DiLoCo: the average pseudo-gradient (the parameters at the last
    synchronisation minus the local ones) is applied to the last synchronised parameters by the
    outer optimizer, built once by ``outer_optimizer(params)`` over that float32 copy. Leaving
    the scope normally synchronises a period in progress, so every rank leaves with the same
    model. In one process plain Local SGD changes nothing.

    Args:
        every: optimizer steps between synchronisations (H).
        outer_optimizer: DiLoCo's outer optimizer, as a function of the parameters that builds
            it (``functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)``).

    Examples:
        >>> import torch
        >>> from accel_ctx import distributed, local_sgd
        >>> with distributed(), local_sgd(every=4):
        ...     model = torch.nn.Linear(2, 1)
        ...     opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ...     for x in torch.randn(8, 3, 2):
        ...         model(x).sum().backward()
        ...         opt.step(); opt.zero_grad()
    """

    def __init__(self, every: int, *, outer_optimizer: OuterOptimizer | None = None) -> None:
        super().__init__()
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigurationError(
                f"local_sgd(every={every!r}): give the number of optimizer steps between "
                "synchronisations, a whole number >= 1.")
        if isinstance(outer_optimizer, torch.optim.Optimizer) or not (
                outer_optimizer is None or callable(outer_optimizer)):
            raise ConfigurationError(
                f"local_sgd(outer_optimizer={type(outer_optimizer).__name__}): give a function "
                "that builds the outer optimizer from the parameters it is given (the scope's "
                "copy of the synchronised weights, not the model's), e.g. "
                "functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True).")
        if outer_optimizer is not None:
            check_outer_optimizer(outer_optimizer)  # called as outer_optimizer(params)
        self.every = every
        self.outer_optimizer = outer_optimizer

    @override
    def _open(self, exits: ExitStack) -> LocalSGDRuntime:
        refuse_parts(_state.current())
        runtime = LocalSGDRuntime(self.every, self.outer_optimizer)
        exits.push(runtime.exit)
        return runtime
