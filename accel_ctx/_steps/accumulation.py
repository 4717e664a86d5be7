"""The runtimes of ``accumulate(k)`` and ``no_sync()``: gradient accumulation with the plain loop.

Under ``accumulate(k)`` each ``loss.backward()`` is one micro-step. The loss is divided by the
size of its group, so the accumulated gradient is the mean over the group's micro-batches, as
one large batch would give. DDP's all-reduce runs only on the group's last backward (decided
at the forward, where DDP needs to know), and ``opt.step()``, ``opt.zero_grad()`` and LR
scheduler steps only take effect after that last backward.

The end of the DataLoader always closes a group. When the loader's length is known, a short
last group of ``m < k`` micro-batches is divided by ``m`` from its first micro-step; when it
is not (an iterable dataset without ``len``), its gradients are multiplied by ``k / m`` after
its last backward. Either way the step sees the mean over the micro-batches it accumulated.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from .._kernel.concern import Concern, ForwardCall, Params
from .._kernel.order import ORDER
from .._kernel.session import OptimizerRecord, Session
from .._warn import warn_user


class PausesEngines(Concern):
    """Sets the gradient sync of the user's own DDP engines, and sets it back at the end."""

    def __init__(self) -> None:
        self._engines: weakref.WeakSet[nn.parallel.DistributedDataParallel] = weakref.WeakSet()

    def _vote(self, call: ForwardCall, session: Session) -> bool:
        raise NotImplementedError

    @override
    def before_forward(self, call: ForwardCall, session: Session) -> None:
        engine = call.engine
        if engine is None or not call.grad:
            return
        call.sync = self._vote(call, session) and call.sync is not False
        if isinstance(engine, nn.parallel.DistributedDataParallel) and engine is call.module:
            self._engines.add(engine)  # the user's own DDP: set back when this scope closes

    def close(self) -> None:
        for engine in list(self._engines):
            engine.require_backward_grad_sync = True


class AccumulateRuntime(PausesEngines):
    """Counters of one ``accumulate(k)`` entry."""

    slot, order = "accumulate", ORDER["accumulate"]

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps
        self.micro = 0  # backward passes so far in the current group
        self.groups = 0  # completed groups
        self.size: int | None = None  # size of the current group, decided at its start
        self.sync_gradients = True  # the last backward closed a group (or none happened yet)
        self._restored: tuple[int, int] | None = None
        self._warned_double_step = False

    def _group_size(self, session: Session) -> int:
        if self.size is None:
            size = self.steps
            loader = session.driving_loader()
            if loader is not None and loader.length is not None:
                remaining = loader.length - max(loader.index, 0)
                size = max(1, min(size, remaining))
            self.size = size
        return self.size

    @override
    def _vote(self, call: ForwardCall, session: Session) -> bool:
        """Whether the backward of the forward about to run closes the group."""
        loader = session.driving_loader()
        return self.micro + 1 >= self._group_size(session) or (
            loader is not None and loader.is_last
        )

    @override
    def before_backward(self, loss: torch.Tensor, session: Session) -> torch.Tensor:
        size = self._group_size(session)
        return loss / size if size > 1 else loss

    @override
    def after_backward(self, session: Session, params: Params) -> None:
        self.micro += 1
        size = self._group_size(session)
        loader = session.driving_loader()
        if self.micro >= size or (loader is not None and loader.is_last):
            if self.micro < size:  # the loader ended a group of unknown length early
                _rescale_grads(params(), size / self.micro)
            self.micro = 0
            self.groups += 1
            self.size = None
            self.sync_gradients = True
        else:
            self.sync_gradients = False

    @override
    def allows_step(self, record: OptimizerRecord) -> bool:
        if not self.sync_gradients:
            return False
        if record.last_group == self.groups:
            if not self._warned_double_step:
                self._warned_double_step = True
                warn_user(
                    "optimizer.step() was called again without a new backward under "
                    "accumulate(); the extra call is skipped. Call step() once per "
                    "micro-batch, after loss.backward().",
                    RuntimeWarning)
            return False
        record.last_group = self.groups
        return True

    @override
    def allows_zero_grad(self, owner: Any) -> bool:
        return self.sync_gradients

    @override
    def defers_clipping(self) -> bool:
        return not self.sync_gradients

    def restart_group(self) -> None:
        """Drop the group in progress: the next backward starts a new one."""
        self.micro, self.size, self.sync_gradients = 0, None, True

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "micro": self.micro, "groups": self.groups,
                "size": self.size, "sync_gradients": self.sync_gradients}

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.micro, self.groups = int(state["micro"]), int(state["groups"])
        self.size, self.sync_gradients = state["size"], bool(state["sync_gradients"])
        # the group the checkpoint was taken in, to continue or drop (resume_group)
        self._restored = (self.micro, int(state["steps"])) if self.micro else None

    @override
    def snapshot(self) -> dict[str, Any]:
        return {"accumulation_steps": self.steps, "sync_gradients": self.sync_gradients}

    @override
    def mid_group(self) -> tuple[int, int] | None:
        return (self.micro, self.steps) if self.micro else None

    @override
    def accumulation_steps(self) -> int | None:
        return self.steps

    @override
    def resume_group(self, grads_kept: bool, put_back: Callable[[], None]) -> None:
        restored, self._restored = self._restored, None
        if restored is None:
            return
        done, size = restored
        if grads_kept and self.steps == size:
            put_back()
            return
        warn_user(
            f"load_state: the checkpoint was saved after micro-batch {done} of an accumulation "
            f"group of {size}; those partial gradients belong to the ranks and "
            f"accumulate({size}) that saved it (or were held inside a sharded model's engine, "
            "and not saved) and are dropped here, so the next group starts afresh. Save after "
            "opt.step() at a group boundary (state().sync_gradients) to resume elsewhere "
            "exactly.")
        self.restart_group()


def _rescale_grads(params: list[torch.Tensor], factor: float) -> None:
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, factor)


class NoSyncRuntime(PausesEngines):
    """Forwards inside skip DDP's gradient all-reduce."""

    slot, order = "sync", ORDER["sync"]

    @override
    def _vote(self, call: ForwardCall, session: Session) -> bool:
        return False
