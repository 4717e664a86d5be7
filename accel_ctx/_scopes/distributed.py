"""``distributed()``: the distributed concern.

The scope forms the job (``_group.group``: environment -> process group -> device) and opens a
:class:`DistributedRuntime`, whose hooks route each top-level module call to the DDP engine
(``_engines.replicate``), move its inputs to the device, and record this rank's progress at every
phase of the step for the other ranks' failure messages (``_group.blame``).
"""

from __future__ import annotations

from contextlib import ExitStack
from types import FrameType
from typing import Any

import torch
from torch import nn
from typing_extensions import Unpack, override

from .._data.eval_passes import last_verdict, verdict
from .._data.replica_inputs import note_inputs, note_loss
from .._engines import (
    adopt as _adopt,
)
from .._engines import (
    choice as _choice,
)
from .._engines import (
    fault_tolerant as _fault_tolerant,
)
from .._engines import (
    fsdp as _fsdp,
)
from .._engines import (
    replicate as _replicate,
)
from .._engines import (
    tensor_parallel as _tensor_parallel,
)
from .._engines import (
    touch as _touch,
)
from .._engines.adopt import release_all
from .._engines.ddp_controls import holds_back
from .._engines.loss_parallel import loss_parallel_on
from .._group import blame as _blame
from .._group.group import start_job
from .._hooks import gates as _gates
from .._hooks.scope import Scope
from .._job import comm_hook as _comm_hook
from .._job.job import Job
from .._job.options import DEFAULT_TIMEOUT, DistributedOptions, Options, check_nested, parse_options
from .._job.progress import AFTER_BACKWARD, AFTER_FORWARD, AFTER_STEP, BACKWARD, FORWARD, STEP
from .._job.tp_plan import TensorPlan
from .._kernel import state as _state
from .._kernel.concern import NOT_FAST, Concern, Engine, FastForward, ForwardCall, Params
from .._kernel.order import ORDER
from .._kernel.session import Session
from .._options import checked
from ..errors import ConfigurationError
from .mixed_precision import check_env_policy, precision_from_env

# Re-exported: the options live with their checks in _dist_options.
__all__ = ["DEFAULT_TIMEOUT", "DistributedOptions", "DistributedRuntime", "distributed",
           "open_runtime"]


@checked
class distributed(Scope):
    """Run the enclosed training code data-parallel on every process of the job.

    Reads the launch environment (``accel-ctx launch``/torchrun, SLURM, Open MPI; none means
    one process), joins the process group, picks the device (``cuda:LOCAL_RANK``, else mps,
    else cpu) and, inside the scope:

    * iterating any DataLoader yields this rank's share of the batches, on the device;
    * the first top-level call of a module with trainable parameters moves it to the device,
      starts every rank from rank 0's weights and averages its gradients with DDP's engine,
      while ``model`` stays the very same object (class, attributes, ``state_dict`` keys).

    Everything it set up is torn down on exit, also on an exception. Nesting is harmless;
    scopes one after another (train, then evaluate; a sweep) each get a fresh setup.

    Options (keyword-only): ``backend``, ``device``, ``timeout`` (seconds or timedelta),
    ``init_method``, ``find_unused_parameters``, ``static_graph``, ``broadcast_buffers``,
    ``bucket_cap_mb``, ``gradient_as_bucket_view``, ``sync_batchnorm``, ``even_batches``,
    ``debug``, ``comm_hook`` (see :class:`DistributedOptions`).

    Examples:
        >>> import torch
        >>> from accel_ctx import distributed, state
        >>> with distributed():
        ...     model = torch.nn.Linear(4, 2)
        ...     out = model(torch.randn(3, 4))
        ...     print(state().world_size, out.shape)
        1 torch.Size([3, 2])
    """


    def __init__(self, **options: Unpack[Options]) -> None:
        super().__init__()
        self.options = parse_options(options)

    @override
    def _open(self, exits: ExitStack) -> DistributedRuntime | tuple[Concern, ...]:
        return open_runtime(self.options, exits, None)


def open_runtime(options: DistributedOptions, exits: ExitStack, plan: _fsdp.ShardingPlan | None
                 ) -> DistributedRuntime | tuple[Concern, ...]:
    """The runtime of a ``distributed()`` (or ``sharded()``: ``plan``) entry: the job of the
    scope below, or a new one. A sharding or tensor-parallel plan below stays in force unless
    this entry gives its own."""
    below = _state.current()
    outer_runtime = below.find(DistributedRuntime) if below is not None else None
    tensor = (TensorPlan(options.tp, options.tp_plan, options.loss_parallel)
              if options.tp is not None and options.tp > 1 else None)
    if tensor is not None and tensor.loss_parallel:
        exits.enter_context(loss_parallel_on())  # the user's loss and backward: on the shards
    if tensor is not None:  # a step that raised left it on: off when the scope ends
        exits.callback(_tensor_parallel.replicate_plain_tensors, False)
    if outer_runtime is not None:
        outer = outer_runtime.job
        check_nested(outer.device, outer.backend, outer.root.options, options)
        plan = plan or outer_runtime.plan
        if options.tp is None:
            tensor = outer_runtime.tensor
        _check_comm_hook(plan, options, outer.root.options)
        _comm_hook.check_device(options.comm_hook, outer.device)
        job = outer.nested(options)
        _check_tensor(job, tensor, plan)
        return DistributedRuntime(job, plan, tensor)
    _check_comm_hook(plan, options)  # before the group forms: every rank refuses alike
    check_env_policy()
    job = start_job(options, exits, on_job=_job_exits)
    _check_tensor(job, tensor, plan)
    runtime = DistributedRuntime(job, plan, tensor)
    replicas: tuple[Concern, ...] = ()
    if job.launch.lighthouse:
        from .._checkpoint import heal  # loads DCP: only in a replica group

        replicas = (_fault_tolerant.ReplicaGroupRuntime(job, exits, heal.PeerState()),)
    default = precision_from_env(job.device, exits)
    more = (*replicas, default) if default is not None else replicas
    return (runtime, *more) if more else runtime


def _job_exits(job: Job, exits: ExitStack) -> None:
    """Undone when the outermost entry leaves, before the group goes: the engines released,
    the verdict on an evaluation that was the job's last loop (``_data.eval_passes``)."""
    exits.callback(release_all, job)
    exits.push(last_verdict(job))


def _check_tensor(job: Job, tensor: TensorPlan | None, plan: _fsdp.ShardingPlan | None) -> None:
    """``distributed(tp=N)`` keeps the split layers replicated over "dp": DDP takes no DTensor
    parameters, so more than one data-parallel rank needs ``sharded(tp=N)`` (FSDP2 over "dp")."""
    where = job.coordinates
    if tensor is not None and plan is None and where.dp_size > 1:
        raise ConfigurationError(
            f"distributed(tp={tensor.size}) on {where.world_size} processes leaves "
            f"{where.dp_size} data-parallel groups, and DDP cannot average the gradients of "
            f"tensor-parallel (DTensor) parameters. Use sharded(tp={tensor.size}) (FSDP2 over "
            f"the data-parallel ranks, torchtitan's recipe), or start {tensor.size} processes.")


def _check_comm_hook(plan: _fsdp.ShardingPlan | None, *options: DistributedOptions) -> None:
    if plan is not None and any(o.comm_hook is not None for o in options):
        raise ConfigurationError(
            "distributed(comm_hook=...) applies to DDP's gradient all-reduce, and sharded() "
            "trains with FSDP2, which has no comm hooks; drop comm_hook, or use distributed() "
            "alone (for lower-precision reductions under sharded(), FSDP2 reduces in fp32 by "
            "design of mixed_precision).")


class DistributedRuntime(Concern):
    """The live side of one ``distributed()`` entry: its job, and the hooks that use it."""

    slot, order = "distributed", ORDER["distributed"]
    job: Job

    def __init__(self, job: Job, plan: _fsdp.ShardingPlan | None = None,
                 tensor: TensorPlan | None = None) -> None:
        self.job = job
        self.plan = plan  # sharded(): FSDP2 for the models adopted from now on
        self.tensor = tensor  # tp=N: tensor parallelism (then FSDP2 over "dp" under sharded())
        # asked, never branched on
        self.engines = _choice.choose(plan, tensor, job.launch.lighthouse is not None)
        # TP without FSDP2 over "dp": the parameters outside the plan stay plain tensors
        self._plain_beside_split = tensor is not None and not _tensor_parallel.shards_over_dp(
            job, plan)

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
        return super().overrides(hook)

    @override
    def before_touch(self, module: nn.Module, session: Session, caller: FrameType) -> None:
        _touch.lay_out_at_touch(self.job, self.engines, module, session, caller)

    @override
    def prepare_for_load(self, objects: dict[str, Any], session: Session) -> None:
        self.engines.prepare_for_load(self.job, objects, session)

