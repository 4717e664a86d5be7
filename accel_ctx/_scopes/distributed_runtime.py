"""The runtime of a ``distributed()`` (or ``sharded()``) entry: the distributed concern.

Its hooks route each top-level module call to the engine the entry chose
(``_engines.choice``: DDP, FSDP2, tensor parallelism, DeepSpeed), move its inputs to the device,
hand the optimizer's steps and clipping to an engine that owns them (DeepSpeed's), and record
this rank's progress at every phase of the step for the other ranks' failure messages
(``_group.blame``).
"""

from __future__ import annotations

from types import FrameType
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from .._data.eval_passes import verdict
from .._data.replica_inputs import note_inputs, note_loss
from .._engines import adopt as _adopt
from .._engines import choice as _choice
from .._engines import fsdp as _fsdp
from .._engines import replicate as _replicate
from .._engines import tensor_parallel as _tensor_parallel
from .._engines import touch as _touch
from .._engines.choice import Plan
from .._engines.ddp_controls import holds_back
from .._engines.replica_client import Healing
from .._group import blame as _blame
from .._hooks import gates as _gates
from .._job.job import Job
from .._job.progress import AFTER_BACKWARD, AFTER_FORWARD, AFTER_STEP, BACKWARD, FORWARD, STEP
from .._job.tp_plan import TensorPlan
from .._kernel import state as _state
from .._kernel.checkpoint_form import CheckpointForm
from .._kernel.concern import NOT_FAST, Concern, Engine, FastForward, ForwardCall, Params
from .._kernel.order import ORDER
from .._kernel.session import Session


def _peer_state() -> Healing:
    """What a replica group keeps for a returning peer (``_checkpoint.heal``)."""
    from .._checkpoint import heal  # loads DCP: only in a replica group

    return heal.PeerState()


_ENGINE_STEPS = frozenset({"runs_step", "clips_in_step", "allows_zero_grad"})


class DistributedRuntime(Concern):
    """The live side of one ``distributed()`` entry: its job, and the hooks that use it."""

    slot, order = "distributed", ORDER["distributed"]
    job: Job

    def __init__(self, job: Job, plan: Plan | None = None,
                 tensor: TensorPlan | None = None) -> None:
        self.job = job
        self.plan = plan  # sharded(): FSDP2 for the models adopted from now on
        self.tensor = tensor  # tp=N: tensor parallelism (then FSDP2 over "dp" under sharded())
        # asked, never branched on
        self.engines = _choice.choose(plan, tensor,
                                      _peer_state if job.launch.lighthouse else None,
                                      job.coordinates.pp_size)
        # TP without FSDP2 over "dp": the parameters outside the plan stay plain tensors
        self._plain_beside_split = tensor is not None and not _tensor_parallel.shards_over_dp(
            job, plan if isinstance(plan, _fsdp.ShardingPlan) else None)

    # ---- a top-level module call ---------------------------------------------------------------
    @override
    def fast_forward(self) -> FastForward | None:
        # DDP's steady state: what before_forward, the gate, forward_failed and forward_done do
        # for it, in their order; the first calls, evaluation, rank-only code, an uneven tail,
        # sharded and tensor-parallel models take the general path
        if (not self.engines.steady_ddp
                or self.job.device.type not in ("cpu", "cuda")):  # else inputs are moved
            return None
        job = self.job
        steady_engine = _replicate.steady_engine
        set_stack, reset_stack = _state.set_stack, _state.reset_stack
        stock = _gates.stock

        def forward(stack: Any, module: nn.Module, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
            engine = steady_engine(job, module)
            if engine is None:
                return NOT_FAST
            progress = job.progress
            progress.seq += 1
            progress.phase, progress.entered_at = FORWARD, None  # no line: Progress.entered_at
            progress.armed = True  # its backward averages gradients with every rank
            sync = not holds_back(module)
            if engine.require_backward_grad_sync is not sync:
                engine.require_backward_grad_sync = sync
            try:
                token = set_stack(stack.forward)  # inside a forward: submodules run stock
                try:
                    return stock.module_call(engine, *args, **kwargs)
                finally:
                    reset_stack(token)
            except Exception as exc:
                _blame.reraise(job, exc, "forward")  # DDP's buffer broadcast
                _replicate.explain_unused_parameters(job, exc)
                raise
            finally:
                progress.phase = AFTER_FORWARD

        return forward

    @override
    def before_forward(self, call: ForwardCall, session: Session) -> None:
        # fast_forward() repeats DDP's steady case of this, forward_failed and forward_done
        # (with the gate's sync vote): a change to one belongs in the other, and
        # tests/scopes/test_hot_path.py runs both on the same calls and compares every effect
        job = self.job
        progress = job.progress  # where this rank is, for the others' error messages
        progress.seq += 1
        progress.phase, progress.entered_at = FORWARD, None  # no line: Progress.entered_at
        engine: Engine | None
        try:
            call.target, engine = self.engines.prepare(job, call.module, call.grad, session)
            if (engine is not None and engine is not call.module and call.grad
                    and not job.adoption.inputs_checked):
                note_inputs(job, call, session)
        except Exception as exc:
            # the engine's setup broadcasts rank 0's weights
            _blame.reraise(job, exc, f"forward ({self.engines.setting_up})")
            raise
        call.engine = engine
        if not call.grad:
            job.root.no_grad_forwards += 1  # an evaluation may be running (_eval_passes)
        if engine is not None and call.grad:
            progress.armed = True  # its backward averages gradients with every rank
            if engine is not call.module:
                # ours: DDP's own controls on the model, the accumulation and no_sync scopes veto
                call.sync = not holds_back(call.module)
        device_type = job.device.type
        if device_type != "cpu" and (engine is None or device_type != "cuda"):
            call.args, call.kwargs = _adopt.inputs_to_device(job, call.args, call.kwargs)
        call.device_type = device_type

    @override
    def forward_failed(self, call: ForwardCall, exc: Exception) -> None:
        if call.engine is not None:
            _blame.reraise(self.job, exc, "forward")  # DDP's buffer broadcast
            _replicate.explain_unused_parameters(self.job, exc)
            if self.tensor is not None:
                _tensor_parallel.explain_failure(call.module, self.tensor, exc)

    @override
    def forward_done(self, call: ForwardCall) -> None:
        self.job.progress.phase = AFTER_FORWARD

    # ---- loss.backward() -------------------------------------------------------------------------
    @override
    def before_backward(self, loss: torch.Tensor, session: Session) -> torch.Tensor:
        job = self.job
        if job.root.pending_eval is not None:
            verdict(job)  # training goes on: judge a finished evaluation pass
        if job.adoption.pending_inputs is not None:
            note_loss(job, loss)  # the first steps: the same batch on every rank? (local)
        progress = job.progress
        if progress.armed and _state.rank_only() is not None and job.world_size > 1:
            _blame.refuse_rank_only("backward()", "DDP's gradient averaging in it")
        progress.seq += 1
        progress.phase, progress.entered_at = BACKWARD, None  # no line: Progress.entered_at
        return loss

    @override
    def backward_failed(self, exc: Exception) -> None:
        _blame.reraise(self.job, exc, "backward")  # DDP's gradient all-reduce

    @override
    def after_backward(self, session: Session, params: Params) -> None:
        progress = self.job.progress
        progress.armed = False
        progress.phase = AFTER_BACKWARD

    # ---- opt.step() ------------------------------------------------------------------------------
    @override
    def first_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        _adopt.adopt_optimizer(self.job, optimizer)  # follow the adopted models to their device

    @override
    def before_step(self, session: Session) -> None:
        progress = self.job.progress
        progress.step, progress.seq = session.step, 0
        progress.phase, progress.entered_at = STEP, None  # no line: Progress.entered_at
        if self._plain_beside_split:
            _tensor_parallel.replicate_plain_tensors(True)

    @override
    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.job.progress.phase = AFTER_STEP
        if self._plain_beside_split:
            _tensor_parallel.replicate_plain_tensors(False)

    # ---- state() and checkpoints -----------------------------------------------------------------
    @override
    def snapshot(self) -> dict[str, Any]:
        job = self.job
        return {**job.coordinates.as_dict(), "device": job.device, "backend": job.backend,
                "distributed": True}

    @override
    def overrides(self, hook: str) -> bool:
        if hook == "before_touch" and not self.engines.lays_out_at_touch:
            return False  # under DDP a model is laid out at its first forward
        if hook in _ENGINE_STEPS and not self.engines.owns_step:
            return False  # the optimizer steps and clips as torch does (no cost per step)
        return super().overrides(hook)

    @override
    def runs_step(self, optimizer: torch.optim.Optimizer) -> bool:
        return self.engines.run_step(optimizer)

    @override
    def allows_zero_grad(self, owner: Any) -> bool:
        return self.engines.allows_zero_grad(owner)

    @override
    def clips_in_step(self, max_norm: float, norm_type: float) -> torch.Tensor | None:
        return self.engines.clip_in_step(max_norm, norm_type)

    @override
    def splits_models(self) -> bool:
        return self.plan is not None or self.tensor is not None or self.job.coordinates.pp_size > 1

    @override
    def full_model_state(self, model: nn.Module) -> dict[str, Any] | None:
        return self.engines.full_state_dict(model)

    @override
    def checkpoint_form(self, obj: Any) -> CheckpointForm | None:
        return self.engines.checkpoint_form(obj)

    @override
    def before_touch(self, module: nn.Module, session: Session, caller: FrameType) -> None:
        _touch.lay_out_at_touch(self.job, self.engines, module, session, caller)

    @override
    def prepare_for_load(self, objects: dict[str, Any], session: Session) -> None:
        self.engines.prepare_for_load(self.job, objects, session)

