"""``distributed()``: the distributed concern.

The scope forms the job (``_group.group``: environment -> process group -> device) and opens a
:class:`DistributedRuntime`, whose hooks route each top-level module call to the DDP engine
(``_engines.replicate``), move its inputs to the device, and record this rank's progress at every
phase of the step for the other ranks' failure messages (``_group.blame``).
"""

from __future__ import annotations

from contextlib import ExitStack

from typing_extensions import Unpack, override

from .._data.eval_passes import last_verdict
from .._engines import ring_attention as _ring
from .._engines import tensor_parallel as _tensor_parallel
from .._engines import zero as _zero
from .._engines.adopt import release_all
from .._engines.choice import Plan
from .._engines.loss_parallel import loss_parallel_on
from .._engines.sequence_parallel import SequenceParallelRuntime
from .._group.group import start_job
from .._hooks.patches import acquire_attention, release_attention
from .._hooks.scope import Scope
from .._job import comm_hook as _comm_hook
from .._job.job import Job
from .._job.options import DEFAULT_TIMEOUT, DistributedOptions, Options, check_nested, parse_options
from .._job.tp_plan import TensorPlan
from .._kernel import state as _state
from .._kernel.concern import Concern
from .._options import checked
from ..errors import ConfigurationError
from .distributed_runtime import DistributedRuntime
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
    ``debug``, ``comm_hook``, ``tp``, ``sp``, ``pp``, ``microbatches``, ``schedule``,
    ``loss_fn`` (see :class:`DistributedOptions`).

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


def open_runtime(options: DistributedOptions, exits: ExitStack, plan: Plan | None
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
        given = options.sp if options.sp is not None else options.cp
        if given is not None and given != outer.coordinates.sp_size:
            raise ConfigurationError(
                f"distributed(sp={given}) is nested inside a scope whose job splits each "
                f"sequence over sp={outer.coordinates.sp_size}; a nested scope cannot change it. "
                "Pass sp= to the outermost scope, or drop it from the nested one.")
        if options.pp is not None and options.pp != outer.coordinates.pp_size:
            raise ConfigurationError(
                f"distributed(pp={options.pp}) is nested inside a scope whose job cuts each "
                f"model into pp={outer.coordinates.pp_size} stages; a nested scope cannot change "
                "it. Pass pp= to the outermost scope, or drop it from the nested one.")
        job = outer.nested(options)
        _check_tensor(job, tensor, plan)
        return DistributedRuntime(job, plan, tensor)
    _check_comm_hook(plan, options)  # before the group forms: every rank refuses alike
    check_env_policy()
    job = start_job(options, exits, on_job=_job_exits)
    _check_tensor(job, tensor, plan)
    runtime = DistributedRuntime(job, plan, tensor)
    beside = (*runtime.engines.open(job, exits), *_sequence(job, plan, exits))
    default = precision_from_env(job.device, exits)
    more = (*beside, default) if default is not None else beside
    return (runtime, *more) if more else runtime


def _sequence(job: Job, plan: Plan | None, exits: ExitStack) -> tuple[Concern, ...]:
    """``sp=N``: the runtime that fits each call to its slice, and attention through Ulysses."""
    share = job.sequence
    if share is None:
        return ()
    if isinstance(plan, _zero.ZeroPlan):
        raise ConfigurationError(
            f"sharded(engine='deepspeed', sp={share.size}): DeepSpeed's ZeRO with sequence "
            "parallelism is not supported; use sharded(sp=...) (FSDP2) or distributed(sp=...).")
    if job.launch.replica_groups > 1:
        raise ConfigurationError(
            f"distributed(sp={share.size}) under --replica-groups: sequence parallelism inside "
            "fault-tolerant replica groups is not supported; drop sp= or --replica-groups.")
    share.mesh = job.sp_mesh  # every rank makes the groups now, not in a traced forward
    share.group = share.mesh.get_group()
    if share.ring:
        exits.enter_context(_ring.dispatching())
    acquire_attention()
    exits.callback(release_attention)
    return (SequenceParallelRuntime(job, share),)


def _job_exits(job: Job, exits: ExitStack) -> None:
    """Undone when the outermost entry leaves, before the group goes: the engines released,
    the verdict on an evaluation that was the job's last loop (``_data.eval_passes``)."""
    exits.callback(_zero.release)  # after the models: DeepSpeed's groups go with the job's
    exits.callback(release_all, job)
    exits.push(last_verdict(job))


def _check_tensor(job: Job, tensor: TensorPlan | None, plan: Plan | None) -> None:
    """``distributed(tp=N)`` keeps the split layers replicated over "dp": DDP takes no DTensor
    parameters, so more than one data-parallel rank needs ``sharded(tp=N)`` (FSDP2 over "dp")."""
    where = job.coordinates
    if tensor is not None and plan is None and where.dp_size > 1:
        raise ConfigurationError(
            f"distributed(tp={tensor.size}) on {where.world_size} processes leaves "
            f"{where.dp_size} data-parallel groups, and DDP cannot average the gradients of "
            f"tensor-parallel (DTensor) parameters. Use sharded(tp={tensor.size}) (FSDP2 over "
            f"the data-parallel ranks, torchtitan's recipe), or start {tensor.size} processes.")


def _check_comm_hook(plan: Plan | None, *options: DistributedOptions) -> None:
    if plan is not None and any(o.comm_hook is not None for o in options):
        raise ConfigurationError(
            "distributed(comm_hook=...) applies to DDP's gradient all-reduce, and sharded() "
            "trains with FSDP2, which has no comm hooks; drop comm_hook, or use distributed() "
            "alone (for lower-precision reductions under sharded(), FSDP2 reduces in fp32 by "
            "design of mixed_precision).")
