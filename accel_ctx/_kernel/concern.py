"""The one protocol every concern's runtime implements.

A scope entry (``distributed()``, ``mixed_precision()``, ``accumulate()``, ``no_sync()``, and
``sharded()`` next) opens a runtime: a :class:`Concern`. The state stack holds the innermost
runtime of each ``slot``, in a fixed ``order``, and the patched call sites iterate them at each
point of a training step: a top-level module call, ``loss.backward()``, ``opt.step()``,
``zero_grad()``, gradient clipping, and checkpoints. A concern overrides only the hooks where it
acts; the stack keeps, per hook, just the runtimes that override it, so a step pays only for the
concerns that are open and care.

The order (``distributed`` 0, ``accumulate`` 10, ``sync`` 20, ``precision`` 30) is the order of
composition: the engine is chosen before the accumulation decides whether it synchronises, the
loss is divided by the group size before the loss scale multiplies it, and autocast is innermost
around the forward.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from types import FrameType
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from .._job.job import Job
    from .checkpoint_form import CheckpointForm
    from .session import OptimizerRecord, Session


NOT_FAST: Any = object()
"""What a fast forward returns for a call it leaves to the general path (``Concern.fast_forward``)."""

FastForward = Callable[[Any, nn.Module, tuple[Any, ...], dict[str, Any]], Any]
"""A whole top-level call ``(stack, module, args, kwargs) -> output`` (or ``NOT_FAST``)."""

_FORWARD_HOOKS = ("before_forward", "forward_context", "after_forward", "forward_failed",
                  "forward_done")


class Engine(Protocol):
    """A data-parallel engine as the concerns see it: DDP, or the FSDP2 engine of sharded()."""

    require_backward_grad_sync: bool
    """Whether the next backward synchronises the gradients across ranks."""


class ForwardCall:
    """One top-level module call, as the concerns shape it before it runs."""

    __slots__ = ("args", "device_type", "engine", "grad", "kwargs", "module", "sync", "target")

    def __init__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 grad: bool) -> None:
        self.module = module
        self.target: Callable[..., Any] = module  # what runs: the module or its engine
        self.args = args
        self.kwargs = kwargs
        self.grad = grad  # gradients are recorded
        # the data-parallel engine whose backward synchronises gradients (the user's own DDP
        # is one too), and whether it will: None leaves its flag as it is
        # DDP's class is an ABC (Joinable): its isinstance is a Python call; the MRO is not
        self.engine: Engine | None = (
            cast(Engine, module) if _DDP in type(module).__mro__ else None)
        self.sync: bool | None = None
        self.device_type: str | None = None  # the job's device type, if a job placed it


_DDP = nn.parallel.DistributedDataParallel


class LossScaling(Protocol):
    """A scope's fp16 loss scaling, as a user's own GradScaler defers to it."""

    def unscale(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale ``optimizer``'s gradients once per step; False if nothing is scaled."""
        ...

    def current_scale(self) -> torch.Tensor | float:
        """The scale (a tensor: on the device)."""
        ...


Params = Callable[[], list[torch.Tensor]]
"""The parameters in play in the scope (optimizers' and adopted models'), computed on demand."""

Grads = tuple[list[torch.Tensor], list[torch.Tensor], float]
"""Gradients for clipping: (unscaled, still scaled, the scale of the latter)."""


class Concern:
    """Base of every concern runtime: each hook does nothing until a concern overrides it.

    Examples:
        >>> from accel_ctx._kernel.concern import Concern
        >>> class Counting(Concern):
        ...     slot, order = "counting", 40
        ...     def __init__(self): self.seen = 0
        ...     def after_backward(self, session, params): self.seen += 1
        >>> Counting().overrides("after_backward"), Counting().overrides("before_step")
        (True, False)
    """

    slot: ClassVar[str]
    """Which concern this is; the innermost runtime of a slot wins."""
    order: ClassVar[int]
    """Where it runs among the open concerns (lower first): ``_kernel.order.ORDER[slot]``."""
    job: Job | None = None
    """The job a distributed concern formed (the stack publishes the innermost one)."""
    is_default = False
    """A fallback (the launcher's precision): any explicit runtime of the slot wins over it."""

    HOOKS: ClassVar[tuple[str, ...]] = (
        "before_forward", "forward_context", "after_forward", "forward_failed", "forward_done",
        "before_backward", "backward_context", "backward_failed", "after_backward",
        "allows_step", "skips_step", "before_step", "runs_step", "after_step", "first_optimizer",
        "allows_zero_grad", "defers_clipping", "grads_for_clipping", "clips_in_step", "before_batch",
        "before_schedule", "before_touch", "loader_met",
    )

    def overrides(self, hook: str) -> bool:
        """Whether this runtime's class implements ``hook``."""
        return getattr(type(self), hook) is not getattr(Concern, hook)

    # ---- a top-level module call ---------------------------------------------------------------
    def fast_forward(self) -> FastForward | None:
        """The whole of this runtime's part in a top-level call, as one function, for stacks
        where it is the only runtime with forward hooks: the same effects as its hooks, in
        their order, without a ``ForwardCall`` and the hook loops (once per step, every step).
        It returns ``NOT_FAST``, having changed nothing, for a call the general path must take.
        None: no such function (the default)."""
        return None

    def before_forward(self, call: ForwardCall, session: Session) -> None:
        """Shape the call: pick what runs, move inputs, decide the engine's gradient sync."""

    def forward_context(self, call: ForwardCall) -> AbstractContextManager[Any] | None:
        """A context the forward runs in (autocast), or None."""
        return None

    def after_forward(self, call: ForwardCall, out: Any) -> Any:
        """The forward's output, as the caller gets it."""
        return out

    def forward_failed(self, call: ForwardCall, exc: Exception) -> None:
        """The forward raised ``exc``: raise a clearer error instead, or return to keep it."""

    def forward_done(self, call: ForwardCall) -> None:
        """The forward ended, by returning or raising."""

    # ---- loss.backward() -------------------------------------------------------------------------
    def before_backward(self, loss: torch.Tensor, session: Session) -> torch.Tensor:
        """The loss to differentiate (divided, scaled)."""
        return loss

    def backward_context(self) -> AbstractContextManager[Any] | None:
        """A context the backward runs in (autocast switched off), or None."""
        return None

    def backward_failed(self, exc: Exception) -> None:
        """The backward raised ``exc``: raise a clearer error instead, or return to keep it."""

    def after_backward(self, session: Session, params: Params) -> None:
        """The backward finished (``session.backward_calls`` counts it already)."""

    # ---- opt.step() and zero_grad() --------------------------------------------------------------
    def allows_step(self, record: OptimizerRecord) -> bool:
        """False: this step() call is not a step at all (mid accumulation group); not counted."""
        return True

    def skips_step(self, optimizer: torch.optim.Optimizer) -> bool | torch.Tensor:
        """True: this step is counted but must not change the parameters (fp16 overflow).

        A tensor: the optimizer skips itself on the device when it is nonzero (a fused step
        given GradScaler's inf flag); the session reads it only when asked.
        """
        return False

    def before_step(self, session: Session) -> None:
        """A step() call was decided (``session.step`` counts it)."""

    def runs_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Take the decided step of ``optimizer`` itself (an engine that owns the step, as
        DeepSpeed's does): True, and the ``step()`` call itself then changes nothing more."""
        return False

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The outermost step() call of ``optimizer`` returned."""

    def first_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer is met for the first time in the session."""

    def allows_zero_grad(self, owner: Any) -> bool:
        """False: the gradients ``owner`` (an optimizer or a module) would clear must stay (mid
        accumulation group; an engine's own buffers, which it clears itself)."""
        return True

    # ---- DataLoader batches and LR schedulers ----------------------------------------------------
    def before_batch(self, session: Session) -> None:
        """A DataLoader iterated in the scope is about to fetch its next batch (or find its end):
        a step boundary when a step was taken since the last batch (resumable()'s saves)."""

    def before_schedule(self, scheduler: Any, session: Session) -> None:
        """``scheduler.step()`` is called, before it decides whether to step."""

    def loader_met(self, loader: Any, record: Any, session: Session) -> None:
        """A DataLoader is iterated for the first time in the session, before its epoch is
        planned (``record``'s resume fields still count: a replica group heals its position)."""

    # ---- gradient clipping -----------------------------------------------------------------------
    def defers_clipping(self) -> bool:
        """True: clipping now would clip a partial sum (mid accumulation group)."""
        return False

    def grads_for_clipping(self, session: Session, params: list[torch.Tensor]) -> Grads | None:
        """The gradients of ``params``, unscaled where possible (fp16), or None."""
        return None

    # ---- the rest --------------------------------------------------------------------------------
    def loss_scaling(self) -> LossScaling | None:
        """The fp16 loss scaling this concern runs (clipping reads its scale; a user's own
        GradScaler defers to it)."""
        return None

    def adopting(self, module: nn.Module) -> None:
        """``distributed()`` adopts ``module``, before it moves and before an engine (DDP, FSDP2,
        TP) is built over its parameters: change them in place now (true half's cast)."""

    def compute_dtype(self) -> torch.dtype | None:
        """The dtype an engine should compute in (a sharded model's parameter dtype), if any."""
        return None

    def before_sharding(self, module: nn.Module) -> None:
        """``module`` is about to be sharded by FSDP2, its parameters as the optimizers know
        them noted (they follow any replaced here): fp8 wraps its weights to gather in float8."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of this runtime (plain data)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    # ---- checkpoints and state(): asked for rarely, through ``Stack.concerns`` -------------------
    def snapshot(self) -> dict[str, Any]:
        """This runtime's fields of a ``state()`` snapshot (``State`` field name -> value)."""
        return {}

    def before_checkpoint(self) -> None:
        """A checkpoint is about to capture the state (end the iteration's pending work)."""

    def mid_group(self) -> tuple[int, int] | None:
        """(micro-batches done, group size) while gradients of an unfinished group are held."""
        return None

    def before_touch(self, module: nn.Module, session: Session, caller: FrameType) -> None:
        """The script (from ``caller``'s frame) is about to read or load ``module``'s parameters
        or state before its first forward (``_engines.touch``): lay it out as training will."""

    def prepare_for_load(self, objects: dict[str, Any], session: Session) -> None:
        """Lay out the models and optimizers about to be loaded as training will use them
        (moved to the device, or sharded: each rank then reads only its own part)."""

    # ---- capabilities: what one concern asks the others, never by their class ----------------
    def writes_checkpoints(self) -> bool:
        """Whether this process writes ``resumable()``'s checkpoints (False: another process
        writes the job's, e.g. the lowest replica group's); every concern must agree."""
        return True

    def average_over_groups(self, tensors: list[torch.Tensor]) -> bool | None:
        """Average ``tensors`` in place over the job's replica groups (a ``local_sgd()`` sync):
        True, or False where the groups' sync failed (``tensors`` then hold nothing meaningful);
        None: this concern joins no groups."""
        return None

    def accumulation_steps(self) -> int | None:
        """The micro-batches per optimizer step this concern accumulates (None: it does not)."""
        return None

    def splits_models(self) -> bool:
        """Whether this concern's engine holds the models in parts (shards, tp splits)."""
        return False

    def clips_in_step(self, max_norm: float, norm_type: float) -> torch.Tensor | None:
        """Clip the gradients in the optimizer's coming step (an engine whose gradients are
        reduced there): the tensor the loop's ``clip_grad_norm_`` returns, holding the norm once
        the step ran; None: clip now, as torch does."""
        return None

    def full_model_state(self, model: nn.Module) -> dict[str, Any] | None:
        """``model``'s full state dict where this concern's engine holds it partitioned in a way
        DCP cannot read (ZeRO-3; collective, empty off rank 0); None: DCP's own gathers it."""
        return None

    def checkpoint_form(self, obj: Any) -> CheckpointForm | None:
        """The form this concern's engine keeps ``obj``'s state in (a model or optimizer
        DeepSpeed holds in its partitions); None: DCP reads and writes it as it is."""
        return None

    def resume_group(self, grads_kept: bool, put_back: Callable[[], None]) -> None:
        """After a restore: continue the group a checkpoint saved mid-way (``put_back()`` gives
        back its partial gradients; ``grads_kept`` says whether they can be), or start afresh."""


class Hooks:
    """Per hook, the bound hooks of the open runtimes that implement it, in order."""

    __slots__ = (*Concern.HOOKS, "fast_forward")

    fast_forward: FastForward | None
    """The one forward-shaping runtime's whole part in a top-level call, if it offers one."""

    before_forward: tuple[Callable[[ForwardCall, Session], None], ...]
    forward_context: tuple[Callable[[ForwardCall], AbstractContextManager[Any] | None], ...]
    after_forward: tuple[Callable[[ForwardCall, Any], Any], ...]
    forward_failed: tuple[Callable[[ForwardCall, Exception], None], ...]
    forward_done: tuple[Callable[[ForwardCall], None], ...]
    before_backward: tuple[Callable[[torch.Tensor, Session], torch.Tensor], ...]
    backward_context: tuple[Callable[[], AbstractContextManager[Any] | None], ...]
    backward_failed: tuple[Callable[[Exception], None], ...]
    after_backward: tuple[Callable[[Session, Params], None], ...]
    allows_step: tuple[Callable[[OptimizerRecord], bool], ...]
    skips_step: tuple[Callable[[torch.optim.Optimizer], bool | torch.Tensor], ...]
    before_step: tuple[Callable[[Session], None], ...]
    runs_step: tuple[Callable[[torch.optim.Optimizer], bool], ...]
    after_step: tuple[Callable[[torch.optim.Optimizer], None], ...]
    first_optimizer: tuple[Callable[[torch.optim.Optimizer], None], ...]
    allows_zero_grad: tuple[Callable[[Any], bool], ...]
    defers_clipping: tuple[Callable[[], bool], ...]
    grads_for_clipping: tuple[Callable[[Session, list[torch.Tensor]], Grads | None], ...]
    clips_in_step: tuple[Callable[[float, float], torch.Tensor | None], ...]
    before_batch: tuple[Callable[[Session], None], ...]
    before_schedule: tuple[Callable[[Any, Session], None], ...]
    before_touch: tuple[Callable[[nn.Module, Session, FrameType], None], ...]
    loader_met: tuple[Callable[[Any, Any, Session], None], ...]

    def __init__(self, concerns: tuple[Concern, ...]) -> None:
        for hook in Concern.HOOKS:
            setattr(self, hook, tuple(getattr(c, hook) for c in concerns if c.overrides(hook)))
        shaping = [c for c in concerns if any(c.overrides(h) for h in _FORWARD_HOOKS)]
        self.fast_forward = shaping[0].fast_forward() if len(shaping) == 1 else None
