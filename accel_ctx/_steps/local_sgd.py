"""``local_sgd(every=H)``: Local SGD, and DiLoCo with an outer optimizer.

Inside the scope every backward runs without DDP's gradient all-reduce (the ``no_sync()``
switch, on the engine ``distributed()`` built), so each ``opt.step()`` updates the rank's own
copy of the model from its own gradients. After every ``H``-th step of an optimizer its
parameters are synchronised:

* plain Local SGD: averaged over the ranks, in place (one float32 all-reduce per device), as
  torch's ``PeriodicModelAverager`` does after ``PostLocalSGDOptimizer``'s steps;
* DiLoCo (``outer_optimizer=``): the scope keeps a float32 copy of the parameters as they were
  at the last synchronisation (the "global" parameters). The pseudo-gradient ``global - local``
  is averaged over the ranks, put in the global copy's ``.grad``, the outer optimizer steps the
  global copy, and the model's parameters take its values.

A step counts where it is taken: under ``accumulate(k)`` only a group's last micro-batch steps,
and a step fp16 skips on an overflow still counts, so every rank synchronises at the same step.
Each optimizer counts its own steps and synchronises its own parameters (the reference,
``PostLocalSGDOptimizer``, wraps one optimizer the same way).

Across replica groups (``accel-ctx launch --replica-groups R``) the steps are local too: while
the scope is open the group's runtime takes no quorum, gradient average or vote per step
(it sees this scope open). A synchronisation averages within the group, then over the groups
in the quorum (asked of the concerns by capability: ``Concern.average_over_groups``), and is
applied only when the groups commit it; a failed one leaves every group's weights as they were.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from typing_extensions import override

from .._engines.buckets import reduce_in_buckets
from .._group import blame as _blame
from .._job.job import Job
from .._kernel import state as _state
from .._kernel.concern import Concern, ForwardCall
from .._kernel.order import ORDER
from .._kernel.session import OptimizerRecord, Session
from ..errors import ConfigurationError
from .accumulation import PausesEngines
from .local_sgd_checks import check_steps, refuse_alone

OuterOptimizer = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
"""Builds DiLoCo's outer optimizer over the list of global (float32) parameters it is given."""

class _Period:
    """One optimizer's synchronisation state: its steps, and DiLoCo's global copy and optimizer."""

    __slots__ = ("optimizer", "outer", "pending", "shared", "steps")

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = weakref.ref(optimizer)
        self.steps = 0  # steps taken (not held back) since the scope opened
        self.pending = False  # a step() call was let through and has not ended yet
        self.shared: list[torch.Tensor] | None = None  # DiLoCo: the parameters at the last sync
        self.outer: torch.optim.Optimizer | None = None

    def params(self) -> list[torch.Tensor]:
        optimizer = self.optimizer()
        if optimizer is None:
            return []
        return [p for group in optimizer.param_groups for p in group["params"]]


class LocalSGDRuntime(PausesEngines):
    """The steps and global copies of one ``local_sgd()`` entry."""

    slot, order = "local_sgd", ORDER["local_sgd"]

    def __init__(self, every: int, outer: OuterOptimizer | None) -> None:
        super().__init__()
        self.every = every
        self.outer = outer
        self._periods: weakref.WeakKeyDictionary[OptimizerRecord, _Period] = (
            weakref.WeakKeyDictionary())
        self._started: list[_Period] = []  # in the order of their first steps (checkpoints)
        self._restored: list[dict[str, Any]] = []  # saved periods not started yet
        self._job: Job | None = None  # the job open at the first step
        self._checked: _state.Stack | None = None
        self._passes = -1  # the session's backward count at the scope's first forward

    @override
    def _vote(self, call: ForwardCall, session: Session) -> bool:
        return False  # every backward stays local

    @override
    def before_forward(self, call: ForwardCall, session: Session) -> None:
        stack = _state.current()
        if stack is not self._checked:  # sharded() opened inside local_sgd(): once per stack
            refuse_parts(stack)
            refuse_alone(stack, self.every)
            self._checked = stack
        if self._passes < 0:  # every rank in step: the ranks' counts are compared from here
            self._passes = session.backward_calls
        super().before_forward(call, session)

    @override
    def allows_step(self, record: OptimizerRecord) -> bool:
        # the last of the step gates: reaching it, the step is taken (or skipped by fp16)
        period = self._periods.get(record)
        if period is None:
            period = self._start(record)
        period.pending = True
        return True

    @override
    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        stack = _state.current()
        record = stack.session.optimizer_record(optimizer) if stack is not None else None
        period = self._periods.get(record) if record is not None else None
        if period is None or not period.pending:
            return
        period.pending = False
        period.steps += 1
        if period.steps % self.every == 0:
            self._sync(period)

    def _start(self, record: OptimizerRecord) -> _Period:
        stack = _state.current()
        assert stack is not None  # a step gate runs inside the stack
        refuse_alone(stack, self.every)  # (a loop with no module call: refused at its step)
        optimizer = next(o for o, r in stack.session.optimizers.items() if r is record)
        if not self._started:
            self._job = stack.job  # the job the periods synchronise in (checked at the exit)
        period = _Period(optimizer)
        if self.outer is not None:
            # the model as it starts: every rank holds rank 0's weights (DDP broadcast them)
            with torch.no_grad():
                period.shared = [p.detach().to(torch.float32, copy=True) for p in period.params()]
            period.outer = _outside_scopes(self.outer, period.shared)
            if not isinstance(period.outer, torch.optim.Optimizer):
                raise ConfigurationError(
                    f"local_sgd(outer_optimizer=...) returned {type(period.outer).__name__}, not "
                    "a torch.optim.Optimizer; give a function of the parameters that builds one, "
                    "e.g. functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True).")
        if self._restored:
            _load_period(period, self._restored.pop(0))
        self._periods[record] = period
        self._started.append(period)
        return period

    def _check(self, period: _Period, job: Job | None, final: bool) -> None:
        """Every rank of the job at the same step (:func:`check_steps`)."""
        stack = _state.current()
        if job is None or stack is None or job.world_size < 2:
            return
        passes = stack.session.backward_calls - max(self._passes, 0)
        what = "its optimizer" if len(self._started) == 1 else (
            f"optimizer {self._started.index(period) + 1} of {len(self._started)}")
        check_steps(job, period.steps, passes, self.every, what, final)

    @torch.no_grad()
    def _sync(self, period: _Period, final: bool = False) -> None:
        stack = _state.current()
        job = stack.job if stack is not None else None
        self._check(period, job, final)
        # the concerns that join replica groups (by capability: their engine is not ours)
        replicas = [c for c in stack.concerns if c.overrides("average_over_groups")] if (
            stack is not None) else []
        params = period.params()
        if period.shared is None:  # plain Local SGD: the average of every rank's parameters
            # across replica groups a failed sync leaves the parameters as they are: a copy
            mean = params if not replicas else [
                p.detach().to(torch.float32, copy=True) for p in params]
            if _average_all(job, mean, replicas) and mean is not params:
                for p, m in zip(params, mean, strict=True):
                    p.copy_(m)
            return
        shared, outer = period.shared, period.outer
        assert outer is not None
        if len(shared) != len(params):
            raise ConfigurationError(
                "local_sgd(outer_optimizer=...): the optimizer's parameters changed inside the "
                "scope (add_param_group?); add them before the scope opens.")
        pseudo = [g - p.to(torch.float32) for g, p in zip(shared, params, strict=True)]
        if not _average_all(job, pseudo, replicas):
            return  # the groups' sync failed: the local weights stay, the next one catches up
        for g, d in zip(shared, pseudo, strict=True):
            g.grad = d
        _outside_scopes(lambda _: outer.step(), shared)
        for p, g in zip(params, shared, strict=True):
            g.grad = None
            p.copy_(g)

    def exit(self, exc_type: type[BaseException] | None, exc: BaseException | None,
             tb: TracebackType | None) -> None:
        """End a period in progress on a normal exit, so every rank leaves with one model; after
        an exception the other ranks may never come, so nothing waits for them."""
        self.close()
        if exc_type is not None or _state.current_job() is not self._job:
            return  # (a distributed() opened inside this scope has closed already)
        job = self._job
        for period in self._started:
            if period.optimizer() is None:
                continue
            if period.steps % self.every:
                self._sync(period, final=True)
            else:  # no sync is due here: every rank must agree on that too
                self._check(period, job, final=True)

    @override
    def state_dict(self) -> dict[str, Any]:
        if not self._started:
            return {}
        return {"every": self.every, "periods": [
            {"steps": p.steps, "shared": p.shared,
             "outer": p.outer.state_dict() if p.outer is not None else None}
            for p in self._started]}

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = list(state["periods"])
        for period, entry in zip(self._started, saved, strict=False):
            _load_period(period, entry)
        self._restored = saved[len(self._started):]  # for optimizers that have not stepped yet


def _load_period(period: _Period, saved: dict[str, Any]) -> None:
    period.steps = int(saved["steps"])
    if period.shared is not None and saved["shared"] is not None:
        with torch.no_grad():
            for g, s in zip(period.shared, saved["shared"], strict=True):
                g.copy_(s)
    if period.outer is not None and saved["outer"] is not None:
        period.outer.load_state_dict(saved["outer"])


def _outside_scopes(fn: Callable[[list[torch.Tensor]], Any], params: list[torch.Tensor]) -> Any:
    """``fn(params)`` with no scope open: the outer optimizer's step is not a step of the loop
    (not counted, not held back by accumulate(), not unscaled by fp16)."""
    token = _state.set_stack(None)
    try:
        return fn(params)
    finally:
        _state.reset_stack(token)


def _average_all(job: Job | None, tensors: list[torch.Tensor],
                 replicas: list[Concern]) -> bool:
    """Average ``tensors`` in place over the job's ranks, then over the replica groups (the
    same rank of each group holds its group's average); False: the groups' sync failed."""
    if job is not None and job.world_size > 1:
        _average(job, tensors)
    return all(c.average_over_groups(tensors) is not False for c in replicas)


def _average(job: Job, tensors: list[torch.Tensor]) -> None:
    """Average ``tensors`` over the ranks in place: one float32 all-reduce per device."""

    def all_reduce(flat: torch.Tensor) -> None:
        try:
            dist.all_reduce(flat)
        except Exception as exc:
            _blame.reraise(job, exc, "local_sgd()'s parameter average")
            raise
        flat.div_(job.world_size)

    reduce_in_buckets(tensors, all_reduce, as_dtype=torch.float32, on=job.comm_device)


def refuse_parts(stack: _state.Stack | None) -> None:
    """local_sgd() averages whole replicas: refused where an engine holds the models in parts."""
    if stack is not None and any(c.splits_models() for c in stack.concerns):
        raise ConfigurationError(_NOT_SHARDED)


_NOT_SHARDED = (
    "local_sgd() synchronises whole replicas of the model, each trained on its own; under "
    "sharded() (FSDP2), tensor or pipeline parallelism (pp=) each rank holds only part of it, "
    "and under sp= each rank's gradient is only its slice of the sequences' part, which is not "
    "supported yet. Use it inside distributed() (DDP) without sp= or pp=.")
