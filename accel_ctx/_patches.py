"""Scoped patches: installed with the first scope, gated per call, undone with the last.

Every patched entry point first reads the ContextVar; with no scope of this thread and process
it is the stock function. The call sites compose the active scopes' policies in a fixed order
(accumulation, then precision, then distribution); the policies live in their own modules.

Intercepted: ``nn.Module.__call__`` (top-level calls only), ``Tensor.backward``,
``DataLoader.__iter__``/``__len__`` (and the index sampler its iterator reads),
``Optimizer.step`` (through torch's global step hooks, so every call path is seen),
``Optimizer.zero_grad``, ``Module.zero_grad``, ``LRScheduler.step`` and subclasses defining
their own, and ``torch.nn.utils.clip_grad_norm_``/``clip_grad_value_``.
Not intercepted: ``torch.autograd.backward``/``autograd.grad``, DataLoader subclasses that
override ``__iter__``, classes defined after the first scope opened, and names bound with
``from torch.nn.utils import clip_grad_norm_`` before it opened (use ``accel_ctx``'s own).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch
import wrapt
from torch import nn
from torch.optim import lr_scheduler
from torch.optim import optimizer as _optim_module
from torch.utils.data import DataLoader

from . import _blame, _clip, _data, _state
from ._progress import AFTER_BACKWARD, AFTER_FORWARD, AFTER_STEP, BACKWARD, FORWARD, STEP
from .errors import PatchConflictError

_MISSING: Any = object()
_VIEW_MARK = "_accel_ctx_skipped_step_view"
_IN_BACKWARD: ContextVar[bool] = ContextVar("accel_ctx_in_backward", default=False)

_lock = threading.RLock()
_users = 0
_fork_hook = False
_undo: list[Callable[[], None]] = []
_stock_backward: Any = None
_stock_module_call: Any = None


class _AttributePatch:
    """One attribute of one class or module, replaced and later put back exactly."""

    def __init__(self, owner: Any, name: str, replacement: Any) -> None:
        self.owner, self.name, self.replacement = owner, name, replacement
        self.original = owner.__dict__.get(name, _MISSING)

    def install(self) -> None:
        setattr(self.owner, self.name, self.replacement)

    def uninstall(self) -> None:
        now = self.owner.__dict__.get(self.name, _MISSING)
        where = f"{getattr(self.owner, '__qualname__', self.owner.__name__)}.{self.name}"
        if now is not self.replacement:
            raise PatchConflictError(
                f"{where} was replaced by other code while an accel_ctx scope was open; "
                "accel_ctx left it as it is now. Apply the other library's patch outside the "
                "scope (before entering or after leaving it)."
            )
        if self.original is _MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.original)


def _wrap(owner: Any, name: str, gate: Callable[..., Any]) -> _AttributePatch:
    return _AttributePatch(owner, name, wrapt.FunctionWrapper(getattr(owner, name), gate))


def _classes_defining(base: type, name: str) -> Iterator[type]:
    seen: set[type] = set()
    todo = [base]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        if name in cls.__dict__:
            yield cls
        todo.extend(cls.__subclasses__())


# ------------------------------------------------------------------------------------------------
# install / uninstall
# ------------------------------------------------------------------------------------------------
def acquire() -> None:
    """Install every patch if this is the first open scope of the process."""
    global _users, _fork_hook
    with _lock:
        if not _fork_hook:
            os.register_at_fork(after_in_child=_forget_in_forked_child)
            _fork_hook = True
        if _users == 0:
            _install()
        _users += 1


def _forget_in_forked_child() -> None:
    """A forked child (DataLoader worker, launch()) has none of its parent's scopes open."""
    global _users, _lock
    _lock = threading.RLock()  # the parent's may have been held by a thread that is gone
    if _users:
        _users = 0
        with contextlib.suppress(PatchConflictError):
            _uninstall()


def release() -> None:
    """Undo every patch when the last open scope of the process closes."""
    global _users
    with _lock:
        _users -= 1
        if _users == 0:
            _uninstall()


def installed() -> bool:
    with _lock:
        return _users > 0


def _install() -> None:
    global _stock_backward, _stock_module_call
    _stock_backward = torch.Tensor.__dict__["backward"]
    _stock_module_call = nn.Module.__dict__["__call__"]
    patches = [
        _AttributePatch(nn.Module, "__call__", _make_module_call(_stock_module_call)),
        _wrap(torch.Tensor, "backward", _backward),
        _wrap(DataLoader, "__iter__", _loader_iter),
        _wrap(DataLoader, "__len__", _loader_len),
        _AttributePatch(DataLoader, "_index_sampler", _index_sampler_property()),
        _wrap(nn.Module, "zero_grad", _zero_grad),
    ]
    patches += [_wrap(c, "zero_grad", _zero_grad) for c in _classes_defining(torch.optim.Optimizer, "zero_grad")]
    patches += [_wrap(c, "step", _scheduler_step) for c in _classes_defining(lr_scheduler.LRScheduler, "step")]
    for module in (torch.nn.utils, torch.nn.utils.clip_grad):
        patches.append(_AttributePatch(module, "clip_grad_norm_", _routed(module.clip_grad_norm_, _clip.clip_grad_norm_)))
        patches.append(_AttributePatch(module, "clip_grad_value_", _routed(module.clip_grad_value_, _clip.clip_grad_value_)))
    try:
        for patch in patches:
            patch.install()
            _undo.append(patch.uninstall)
        pre = _optim_module.register_optimizer_step_pre_hook(_before_step)
        _undo.append(pre.remove)
        post = _optim_module.register_optimizer_step_post_hook(_after_step)
        _undo.append(post.remove)
    except BaseException:
        _uninstall()
        raise


def _uninstall() -> None:
    conflicts: list[PatchConflictError] = []
    while _undo:
        undo = _undo.pop()
        try:
            undo()
        except PatchConflictError as exc:
            conflicts.append(exc)
    if conflicts:
        raise conflicts[0]


# ------------------------------------------------------------------------------------------------
# nn.Module.__call__: the hot path
# ------------------------------------------------------------------------------------------------
def _make_module_call(stock: Any) -> Callable[..., Any]:
    get_stack = _state._STACK.get
    code = getattr(stock, "__code__", None)
    if stock is nn.Module._wrapped_call_impl and code is not None and code.co_names == (
        "_compiled_call_impl",
        "_call_impl",
    ):
        # Same two lines as torch's _wrapped_call_impl, plus one ContextVar read: calling
        # through to the stock function would add a Python frame to every submodule call.
        def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            stack = get_stack()
            if stack is not None and not stack.in_forward:
                return _top_level_call(stack, self, args, kwargs)
            if self._compiled_call_impl is not None:
                return self._compiled_call_impl(*args, **kwargs)
            return self._call_impl(*args, **kwargs)  # type: ignore[no-untyped-call]

    else:  # torch changed, or another library patched __call__ first: wrap what is there

        def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            stack = get_stack()
            if stack is not None and not stack.in_forward:
                return _top_level_call(stack, self, args, kwargs)
            return stock(self, *args, **kwargs)

    __call__.__wrapped__ = stock  # type: ignore[attr-defined]
    __call__.__doc__ = getattr(stock, "__doc__", None)
    return __call__


def _module_device_type(module: nn.Module) -> str:
    for p in module.parameters():
        return p.device.type
    return "cpu"


def _top_level_call(
    stack: _state.Stack, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """A module called outside any adopted forward: adopt it, sync policy, autocast."""
    if not stack.owned_here():  # a forked worker or a thread that inherited the context
        return _stock_module_call(module, *args, **kwargs)
    runtime = stack.dist
    grad = torch.is_grad_enabled()
    if runtime is not None:
        progress = runtime.progress  # where this rank is, for the others' error messages
        progress.seq += 1
        progress.phase = FORWARD
        try:
            call, engine = runtime.prepare(module, grad)  # builds DDP: a broadcast from rank 0
        except Exception as exc:
            _blame.reraise(runtime, exc, "forward (setting up DDP)")
            raise
        if engine is not None and grad:
            progress.armed = True  # its backward averages gradients with every rank
        if engine is None or runtime.device.type != "cuda":
            args, kwargs = runtime.inputs_to_device(args, kwargs)
        device_type: str | None = runtime.device.type
    else:
        call = module
        engine = module if isinstance(module, nn.parallel.DistributedDataParallel) else None
        device_type = None
    if engine is not None and grad:
        accumulation, no_sync = stack.accumulate, stack.sync
        if engine is not module or accumulation is not None or no_sync is not None:
            engine.require_backward_grad_sync = no_sync is None and (
                accumulation is None or accumulation.will_sync(stack.session)
            )
            if engine is module:  # the user's own DDP: set back when that scope closes
                (no_sync or accumulation).pause(engine)  # type: ignore[union-attr]
    precision = stack.effective_precision()
    token = _state.enter_forward(stack)
    try:
        if precision is None:
            return call(*args, **kwargs)
        with precision.autocast(device_type or _module_device_type(module)):
            out = call(*args, **kwargs)
        return precision.cast_output(out)
    except Exception as exc:
        if runtime is not None and engine is not None:
            _blame.reraise(runtime, exc, "forward")  # DDP's buffer broadcast
        raise
    finally:
        _state.reset(token)
        if runtime is not None:
            runtime.progress.phase = AFTER_FORWARD


# ------------------------------------------------------------------------------------------------
# Tensor.backward
# ------------------------------------------------------------------------------------------------
def _params_in_play(stack: _state.Stack) -> list[torch.Tensor]:
    params: dict[int, torch.Tensor] = {}
    for optimizer in list(stack.session.optimizers):
        for group in optimizer.param_groups:
            params.update((id(p), p) for p in group["params"])
    if stack.dist is not None:
        for module in list(stack.dist.base.adopted):
            params.update((id(p), p) for p in module.parameters())
    return list(params.values())


def _backward(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    stack = _state.current()
    if stack is None or _IN_BACKWARD.get():
        return wrapped(*args, **kwargs)
    session = stack.session
    runtime = stack.dist
    if runtime is not None:
        progress = runtime.progress
        if progress.armed and runtime.world_size > 1:
            _blame.refuse_rank_only("backward()", "DDP's gradient averaging in it")
        progress.seq += 1
        progress.phase = BACKWARD
    loss = instance
    accumulation = stack.accumulate
    if accumulation is not None:
        loss = accumulation.scale_loss(loss, session)
    precision = stack.effective_precision()
    if precision is not None:
        loss = precision.scale_loss(loss)
    # Tensor subclasses dispatch backward through __torch_function__ back to this patch.
    token = _IN_BACKWARD.set(True)
    try:
        result = _stock_backward(loss, *args, **kwargs)
    except Exception as exc:
        if runtime is not None:
            _blame.reraise(runtime, exc, "backward")  # DDP's gradient all-reduce
        raise
    finally:
        _IN_BACKWARD.reset(token)
    if runtime is not None:
        progress.armed = False
        progress.phase = AFTER_BACKWARD
    session.backward_calls += 1
    if accumulation is not None:
        accumulation.after_backward(session, lambda: _params_in_play(stack))
    return result


# ------------------------------------------------------------------------------------------------
# DataLoader
# ------------------------------------------------------------------------------------------------
def _loader_iter(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    stack = _state.current()
    if stack is None:
        return wrapped(*args, **kwargs)
    return _data.scoped_iter(stack, instance, wrapped)


def _loader_len(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    stack = _state.current()
    if stack is None:
        return wrapped(*args, **kwargs)
    return _data.scoped_len(stack, instance, wrapped)


def _index_sampler_property() -> property:
    stock = DataLoader.__dict__["_index_sampler"]

    def _index_sampler(loader: DataLoader[Any]) -> Any:
        record = _state.peek_loader_record(loader)
        if record is not None and record.plan is not None:  # our __iter__ is building it
            return record.view
        return stock.fget(loader)

    return property(_index_sampler, doc=stock.__doc__)


# ------------------------------------------------------------------------------------------------
# optimizers and schedulers
# ------------------------------------------------------------------------------------------------
def _skipped_view(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A stand-in with the optimizer's settings but no parameters: its step() changes nothing."""
    view: torch.optim.Optimizer = object.__new__(type(optimizer))
    view.__dict__.update(optimizer.__dict__)
    view.__dict__["param_groups"] = [{**g, "params": []} for g in optimizer.param_groups]
    view.__dict__[_VIEW_MARK] = True
    return view


def _optimizer_record(stack: _state.Stack, optimizer: torch.optim.Optimizer) -> _state.OptimizerRecord:
    record = stack.session.optimizers.get(optimizer)
    if record is None:
        record = stack.session.optimizer(optimizer)
        if stack.dist is not None:  # first sight: follow the adopted models to their device
            stack.dist.base.adopt_optimizer(optimizer)
    return record


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
    if optimizer.__dict__.get(_VIEW_MARK):
        return None
    stack = _state.current()
    if stack is None:
        return None
    session = stack.session
    record = _optimizer_record(stack, optimizer)
    if record.depth and record.depth_mark == session.backward_calls:
        record.depth += 1  # a subclass's step() calling super().step(): the outer call decided
        return None
    record.depth, record.depth_mark = 1, session.backward_calls
    record.calls += 1
    accumulation = stack.accumulate
    skip = accumulation is not None and not accumulation.step_allowed(record)
    if not skip:
        group = accumulation.groups if accumulation is not None else session.backward_calls
        if session.last_counted_group != group:
            session.last_counted_group = group
            session.step += 1
        precision = stack.effective_precision()
        if precision is not None and precision.must_skip(optimizer):
            skip = True
            precision.skipped_steps += 1
            session.skipped_steps += 1
    record.skipping = skip
    if stack.dist is not None:
        progress = stack.dist.progress
        progress.step, progress.seq, progress.phase = session.step, 0, STEP
    if skip:
        return ((_skipped_view(optimizer), *args[1:]), kwargs)
    return None


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    stack = _state.current()
    if stack is None:
        return
    record = stack.session.optimizers.get(optimizer)
    if record is None or record.depth == 0:
        return
    record.depth -= 1
    if record.depth == 0 and not record.skipping:
        record.real += 1
    if record.depth == 0 and stack.dist is not None:
        stack.dist.progress.phase = AFTER_STEP


def _zero_grad(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    stack = _state.current()
    if stack is not None:
        if isinstance(instance, torch.optim.Optimizer):
            _optimizer_record(stack, instance)  # known from now on (clipping under fp16)
        accumulation = stack.accumulate
        if accumulation is not None and not accumulation.sync_gradients:
            return None  # mid-group: the accumulated gradients must stay
    return wrapped(*args, **kwargs)


def _scheduler_step(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    stack = _state.current()
    if stack is not None and _schedule_must_wait(stack.session, instance):
        return None
    return wrapped(*args, **kwargs)


def _schedule_must_wait(session: _state.Session, scheduler: Any) -> bool:
    """Skip when the optimizer was stepped since the last schedule step, but never for real."""
    optimizer = getattr(scheduler, "optimizer", None)
    record = session.optimizers.get(optimizer) if optimizer is not None else None
    now = (record.calls, record.real) if record is not None else (0, 0)
    seen = session.schedulers.get(scheduler)
    session.schedulers[scheduler] = now
    if seen is None or record is None:
        return False
    return now[0] > seen[0] and now[1] == seen[1]


# ------------------------------------------------------------------------------------------------
# gradient clipping
# ------------------------------------------------------------------------------------------------
def _routed(stock: Any, scoped: Callable[..., Any]) -> Any:
    def gate(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if _state.current() is None:
            return wrapped(*args, **kwargs)
        return scoped(*args, **kwargs)

    return wrapt.FunctionWrapper(stock, gate)
