"""What runs inside the optimizer's and LR schedulers' patched entry points while a scope is open.

``_hooks.patches`` installs these with the first scope: torch's global optimizer step hooks
(``before_step``/``after_step``), the ``chain`` of ``torch.optim.optimizer``'s hook loops
(``HookChain``), ``Optimizer.zero_grad`` and ``LRScheduler.step``. The common parts live here:
counting steps, re-entrant ``step()`` calls, skipping a step without touching the parameters,
LR schedulers that wait for real steps; each open concern's part runs through its hooks.
"""

from __future__ import annotations

import collections
import functools
import itertools
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any

import torch

from .._kernel import state as _state
from .._kernel.session import OptimizerRecord, Session
from .._steps import schedule_length as _schedule_length
from .._warn import warn_user

VIEW_MARK = "_accel_ctx_skipped_step_view"
_get_ident = threading.get_ident
_read_stack = _state.read_stack
_Optimizer = torch.optim.Optimizer
_watched_in = _schedule_length.WATCHED.get
# torch.distributed.checkpoint's function that steps a fresh optimizer at lr 0 to create its state
_DCP_STATE_DICT, _FILLS_STATE = "torch.distributed.checkpoint.state_dict", "_init_optim_state"


def skipped_view(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A stand-in with the optimizer's settings but no parameters: its step() changes nothing."""
    view: torch.optim.Optimizer = object.__new__(type(optimizer))
    view.__dict__.update(optimizer.__dict__)
    view.__dict__["param_groups"] = [{**g, "params": []} for g in optimizer.param_groups]
    view.__dict__[VIEW_MARK] = True
    return view


class HookChain:
    """``itertools.chain`` as ``torch.optim.optimizer`` sees it while a scope is open.

    torch's step wrapper runs ``for hook in chain(global hooks, the optimizer's hooks)`` before
    and after the step. A ``step()`` call that a scope holds back (mid ``accumulate()`` group,
    an fp16 overflow) is not a step: as with ``GradScaler.step``, which never calls
    ``optimizer.step()`` on an overflow, none of the hooks that others registered may run for it
    (EMA updaters, step counters). Our pre-hook, first of the global ones, hands the step a
    :func:`skipped_view`; every other hook of that call sees it as the step's first argument and
    is left out. Only the hook loops of that module use ``chain(a, b)``;
    ``chain.from_iterable`` is itertools' own.
    """

    from_iterable = staticmethod(itertools.chain.from_iterable)

    def __new__(cls, *hook_groups: Iterable[Any]) -> Iterator[Any]:  # type: ignore[misc]
        if len(hook_groups) == 2:
            # Every step, twice: torch's global hooks (ours alone, unless others registered
            # some) and the optimizer's own (usually none). Only ours: iterate its dict view
            # itself, as torch's own chain would, without a generator per call.
            first, second = hook_groups
            ours: Any = second if not first else first if not second else None
            if type(ours) in _VALUES_VIEWS and len(ours) == 1:
                for only in ours:
                    if only is before_step or only is after_step:
                        return iter(ours)
        return _hooks_of_a_step(hook_groups)


def _hooks_of_a_step(hook_groups: tuple[Iterable[Any], ...]) -> Iterator[Any]:
    for group in hook_groups:
        for hook in group:
            yield hook if hook is before_step or hook is after_step or not callable(hook) \
                else functools.partial(_unless_held_back, hook)


def _unless_held_back(hook: Callable[..., Any], optimizer: torch.optim.Optimizer,
                      args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if args and getattr(args[0], "__dict__", {}).get(VIEW_MARK):
        return None  # a held-back step() call: not a step
    return hook(optimizer, args, kwargs)


# torch keeps its hooks in OrderedDicts (the global ones) and dicts (an optimizer's own)
_VALUES_VIEWS: tuple[type[Any], ...] = (type({}.values()), type(collections.OrderedDict().values()))


def optimizer_record(stack: _state.Stack, optimizer: torch.optim.Optimizer) -> OptimizerRecord:
    record = stack.session.optimizer_record(optimizer)
    if record is None:
        record = stack.session.optimizer(optimizer)
        for first in stack.hooks.first_optimizer:  # e.g. follow the adopted models' devices
            first(optimizer)
    return record


def before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
    if VIEW_MARK in optimizer.__dict__:
        return None
    stack = _read_stack()  # _state.current(), inlined: once per step
    if stack is None or stack.pid != _state._pid or stack.thread != _get_ident():
        return None
    if not optimizer.state and _DCP_STATE_DICT in sys.modules:
        # DCP's get/set_state_dict fill a stateless optimizer's state with a step() at lr 0: not
        # a training step (stock torch's, uncounted, never held back). Walked here, not in a
        # helper: a plain SGD's every step comes by (tests/scopes/test_hot_path.py counts calls)
        frame: FrameType | None = sys._getframe(1)
        for _ in range(4):  # a few frames up, below torch's step wrapper
            if frame is None:
                break
            if (frame.f_code.co_name == _FILLS_STATE
                    and frame.f_globals.get("__name__") == _DCP_STATE_DICT):
                return None
            frame = frame.f_back
    session = stack.session
    hooks = stack.hooks
    record = session.optimizer_record(optimizer)
    if record is None:  # met for the first time
        record = optimizer_record(stack, optimizer)
    if record.depth and record.depth_mark == session.backward_calls:
        record.depth += 1  # a subclass's step() calling super().step(): the outer call decided
        return None
    if record.calls and record.depth_mark == session.backward_calls and not record.skipping:
        _no_backward_seen(stack)  # its last step was taken, on the gradients of this backward
    record.depth, record.depth_mark = 1, session.backward_calls
    record.calls += 1
    skip = False
    for allows in hooks.allows_step:
        if not allows(record):
            skip = True
            break
    if not skip:
        # one step per backward, however many optimizers take it
        if session.last_counted_group != session.backward_calls:
            session.last_counted_group = session.backward_calls
            session.step += 1
        for skips in hooks.skips_step:
            verdict = skips(optimizer)
            if isinstance(verdict, torch.Tensor):  # the device decides; read when asked
                session.skip_later(record, verdict)
            elif verdict:
                skip = True
                session.skipped_steps += 1
                break
    record.skipping = skip
    for before in hooks.before_step:
        before(session)
    if not skip:
        for runs in hooks.runs_step:  # DeepSpeed's engine.step(): the optimizer's step in it
            if runs(optimizer):
                return ((skipped_view(optimizer), *args[1:]), kwargs)
    if skip:
        return ((skipped_view(optimizer), *args[1:]), kwargs)
    return None


_told_no_backward: weakref.WeakSet[Session] = weakref.WeakSet()  # the sessions told, once each


def _no_backward_seen(stack: _state.Stack) -> None:
    """An optimizer stepped again with no ``loss.backward()`` seen since its last step: most
    often a loop that calls ``torch.autograd.backward``, which the scopes do not intercept, so
    ``state().step`` stays where it was (a ``while state().step < N`` loop never ends)."""
    if "accumulate" in stack.slots or stack.session in _told_no_backward:
        return  # accumulate() says it in its own words
    _told_no_backward.add(stack.session)
    warn_user(
        "optimizer.step() ran again with no loss.backward() since its last step. The scope "
        "counts steps (state().step), accumulates and averages over replica groups by "
        "loss.backward(); torch.autograd.backward() and torch.autograd.grad are not seen, so "
        "state().step did not move. Call loss.backward() instead, once before each step.",
        RuntimeWarning)


def after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    stack = _read_stack()  # _state.current(), inlined: once per step
    if stack is None or stack.pid != _state._pid or stack.thread != _get_ident():
        return
    record = stack.session.optimizer_record(optimizer)
    if record is None or record.depth == 0:
        return
    record.depth -= 1
    if record.depth == 0:
        if not record.skipping:
            record.real += 1
        for after in stack.hooks.after_step:
            after(optimizer)


def zero_grad(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    stack = _read_stack()  # _state.current(), inlined: once per step
    if stack is not None and stack.pid == _state._pid and stack.thread == _get_ident():
        if isinstance(instance, _Optimizer) and stack.session.optimizer_record(instance) is None:
            optimizer_record(stack, instance)  # known from now on (clipping under fp16)
        for allows in stack.hooks.allows_zero_grad:
            if not allows(instance):
                return None  # mid-group: the accumulated gradients must stay
    return wrapped(*args, **kwargs)


def scheduler_step(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    stack = _state.current()
    if stack is None:
        return wrapped(*args, **kwargs)
    for before in stack.hooks.before_schedule:  # e.g. resumable() restores it first
        before(instance, stack.session)
    job = stack.job  # a length kept from Accelerate's arithmetic is checked at the job's end
    if (job is not None and job.coordinates.world_size > 1
            and instance not in _watched_in(job.root, ())):
        _schedule_length.watch(instance, job)
    if schedule_must_wait(stack.session, instance):
        return None
    return wrapped(*args, **kwargs)


def schedule_must_wait(session: Session, scheduler: Any) -> bool:
    """Wait when the optimizer was stepped since the last schedule step, but never for real, or
    when it was not stepped since and its last ``step()`` was held back (a second call in the
    same micro-step of an ``accumulate()`` group). Several calls after a real step all run
    (Accelerate's ``world_size`` calls at the boundary)."""
    optimizer = getattr(scheduler, "optimizer", None)
    record = session.optimizers.get(optimizer) if optimizer is not None else None
    if record is not None:
        session.read_skips(record)  # a fused fp16 step skipped on the device: learn it now
    now = (record.calls, record.real) if record is not None else (0, 0)
    seen = session.schedulers.get(scheduler)
    session.schedulers[scheduler] = now
    if record is None:
        return False
    if seen is None:  # made before the scope: its first step here follows the last step() call
        return record.skipping and getattr(scheduler, "_step_count", 1) > 0  # 0: being made
    if now == seen and record.skipping:
        _warn_again(scheduler)
        return True
    return now[0] > seen[0] and now[1] == seen[1]


_told_again: weakref.WeakSet[Any] = weakref.WeakSet()
"""Schedulers told once that a second step() after a held-back optimizer step waits too."""


def _warn_again(scheduler: Any) -> None:
    if scheduler in _told_again:
        return
    _told_again.add(scheduler)
    name = type(scheduler).__name__
    warn_user(
        f"{name}.step() was called again with no optimizer step() since, and that step() was "
        "held back (mid accumulate() group, or skipped on an fp16 overflow): the extra call "
        "waits too. Call the scheduler's step() once per opt.step(), or guard several calls "
        "with `if state().sync_gradients:`.", RuntimeWarning)
