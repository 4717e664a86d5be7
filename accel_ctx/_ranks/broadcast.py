"""broadcast and broadcast_object, whose first message also checks that the ranks agree on src.

torch's broadcast_object_list starts with a broadcast of the payload's size; when two ranks each
believe they are the source, both send, neither receives, and each returns its own object as if
it had been sent. Here the size travels in the header every collective of ours starts with
(``_ranks.exchange``: one all_gather), beside a hash of each rank's call and ``src``: every rank sees
every rank's header, so a disagreement (on ``src``, or a rank in another collective) raises on
every rank and none returns a value.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from .._group import debug as _debug
from .._group.blame import collective
from .._kernel.tree import iter_tensors, map_tensors
from .._options import checked
from ..errors import ConfigurationError
from .collectives import group_job
from .exchange import header, of_call, pickled

if TYPE_CHECKING:
    from .._job.job import Job

T = TypeVar("T")
_ADVICE = "Give every rank the same src (a rank number, not `state().rank`)."


class _Slot:
    """Stands for one tensor of the broadcast structure: its shape, dtype, and CPU or not."""

    __slots__ = ("accelerated", "dtype", "shape")

    def __init__(self, t: torch.Tensor) -> None:
        self.shape = tuple(t.shape)
        self.dtype = t.dtype
        self.accelerated = t.device.type != "cpu"


@collective
@checked
def broadcast(tensors: T, src: int = 0) -> T:
    """Every rank gets rank ``src``'s tensors (a tensor or a nested structure of them).

    Only ``src``'s input matters: shapes (first dimensions included), dtypes and the structure
    come from it, so the other ranks may pass anything, e.g. None; leaves that are not tensors
    (numbers, strings, other picklable objects) come along as they are. Tensors that ``src``
    keeps on the CPU arrive on the CPU, the others on this rank's device. ``src`` gets its
    input back. Ranks that disagree on ``src`` all raise :class:`DistributedError` (checked
    in the first message, which the call sends anyway). In a single process the input itself
    is returned.

    Examples:
        >>> import torch
        >>> from accel_ctx import broadcast
        >>> broadcast({"seed": torch.tensor(42)}, src=0)
        {'seed': tensor(42)}
    """
    job = group_job()
    if job is None:
        _check_alone("broadcast", src)
        return tensors
    me = job.rank == src
    _debug.check(job, f"broadcast(src={src})")
    leaves = list(iter_tensors(tensors)) if me else []
    skeleton = _send_object(job, "broadcast", map_tensors(tensors, _Slot) if me else None,
                            src)
    slots: list[_Slot] = []
    map_tensors(skeleton, lambda t: t, lambda o: slots.append(o) if isinstance(o, _Slot) else o)
    received: dict[int, torch.Tensor] = {}
    for (dtype, accelerated), group in _groups(slots, lambda s: (s.dtype, s.accelerated)).items():
        home = job.device if accelerated else torch.device("cpu")
        device = job.comm_device(home)
        sizes = [_numel(slots[i].shape) for i in group]
        if me:
            flat = torch.cat([leaves[i].detach().reshape(-1).to(device) for i in group])
        else:
            flat = torch.empty(sum(sizes), dtype=dtype, device=device)
        dist.broadcast(flat, src)
        for i, part in zip(group, torch.split(flat, sizes), strict=True):
            received[i] = part.view(slots[i].shape).to(home)
    if me:
        return tensors
    done = iter([received[i] for i in range(len(slots))])
    return map_tensors(  # type: ignore[no-any-return]
        skeleton, lambda t: t, lambda o: next(done) if isinstance(o, _Slot) else o
    )


@collective
@checked
def broadcast_object(obj: T, src: int = 0) -> T:
    """Every rank gets rank ``src``'s ``obj`` (any picklable object); ``src`` gets its own back.

    Ranks that disagree on ``src`` all raise :class:`DistributedError`; an object ``src``
    cannot pickle raises on every rank.

    Examples:
        >>> from accel_ctx import broadcast_object
        >>> broadcast_object({"run_name": "baseline"})
        {'run_name': 'baseline'}
    """
    job = group_job()
    if job is None:
        _check_alone("broadcast_object", src)
        return obj
    _debug.check(job, f"broadcast_object(src={src})")
    received = _send_object(job, "broadcast_object", obj, src)
    return obj if job.rank == src else received


def _check_alone(call: str, src: Any) -> None:
    if not _valid_src(1, src):
        raise ConfigurationError(f"{call}(src={src!r}): a single process has only rank 0: "
                                 "give src=0.")


def _valid_src(world: int, src: Any) -> bool:
    return not isinstance(src, bool) and isinstance(src, int) and 0 <= src < world


def _send_object(job: Job, call: str, obj: Any, src: int) -> Any:
    """``src``'s ``obj`` on every rank: the checked header with its size, then the bytes."""
    valid = _valid_src(job.world_size, src)
    me = valid and job.rank == src
    payload, problem = pickled(obj) if me else (b"", "")
    device = job.comm_device(torch.device("cpu"))
    described = of_call(f"{call}(src={src!r})", f"{call}()")
    rows = header(job, described, device, _ADVICE, nbytes=-1 if problem else len(payload))
    world = job.world_size
    if not valid:
        raise ConfigurationError(f"{call}(src={src!r}): give a rank between 0 and {world - 1}.")
    size = rows[src][4]
    if size < 0:
        raise ConfigurationError(
            f"{call}(src={src}): rank {src} could not pickle its object"
            + (f" ({problem})" if problem else "") + "; send picklable data (or tensors)."
        )
    if me:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    else:
        data = torch.empty(size, dtype=torch.uint8, device=device)
    dist.broadcast(data, src)
    return obj if me else pickle.loads(data.cpu().numpy().tobytes())


def _groups(items: list[Any], key: Callable[[Any], Any]) -> dict[Any, list[int]]:
    groups: dict[Any, list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault(key(item), []).append(i)
    return groups


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
