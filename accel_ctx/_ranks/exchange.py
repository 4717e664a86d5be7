"""The header every collective of ours starts with: the ranks' calls checked before data moves.

Every collective (gather, gather_for_metrics, gather_object, pad_across_processes, reduce,
broadcast, broadcast_object) opens with the same message: one all_gather of ``HEADER`` int64s
per rank. So whatever two ranks call, their first messages pair up in gloo/NCCL without
aborting, and each rank reads every rank's header. The header carries a hash of the rank's
*description* of its call: the function and its arguments (``reduce(op='sum')``,
``broadcast(src=0)``), the input's structure (containers, keys, lengths), for each tensor its
dtype, its number of dimensions, every size but the free one (the dimension that may differ:
gather's dim 0, pad's ``dim``) and the device it travels on, and where it holds plain Python
data. When the hashes differ (ranks in different functions, or inputs that do not fit), every
rank sees it in the same headers, so every rank takes the same error path: one more exchange of
the readable descriptions, then a :class:`DistributedError` naming each rank's call and
shapes, raised before any tensor moves (a mismatched all_gather would abort gloo with SIGABRT or
hand one rank garbage). The rest of the header carries what the call needs anyway: the free
sizes of the first ``INLINE`` tensors (gather, pad), the data itself (a small reduce), the
length of pickled Python data (gather's skeletons, gather_object, broadcast's payload), so a
matching call costs no extra round trip.

Plain Python data (lists of per-sample objects, numbers, strings) is gathered through the
*skeleton*: the input with each tensor replaced by a :class:`Slot`, pickled once per call; its
length rides in the header, so the skeletons cost one more all_gather, not two.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import pickle
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
import torch.distributed as dist

from .._job.job import Job
from ..errors import ConfigurationError, DistributedError
from .skeleton import Slot, holds, rebuild_mapping, rebuild_sequence

_MAGIC = 0x61636378  # "accx": a header that is not ours means a different call on that rank
FIXED = 5  # magic, hash, number of tensors, flags, bytes of pickled Python data
INLINE = 59  # free sizes carried by the header itself; more cost one more small all_gather
HEADER = FIXED + INLINE
HAS_DATA = 1  # flag: the input holds plain Python data to exchange as objects
PADDING = 2  # flag (gather_for_metrics): this rank's batch is padding


class Described:
    """One rank's input, described: what must agree across ranks, and what may differ."""

    def __init__(self, free_dim: int | None, batches: bool, numbers: bool,
                 travel: Callable[[torch.Tensor], str], name: str = "",
                 sizes_free: bool = False) -> None:
        self.name = name  # the call as error messages head it: "gather()", "broadcast()"
        self.free_dim = free_dim  # None: every dimension must agree (reduce)
        # every size may differ, only the number of dimensions must agree (pad_across_processes
        # pads one dimension; a last batch shorter on one rank differs in another)
        self.sizes_free = sizes_free
        self.batches = batches  # lists holding no tensor are batches of per-sample objects
        self.numbers = numbers  # Python numbers become 0-dim tensors (reduce)
        self.travel = travel  # the device type a tensor travels on
        self.tensors: list[torch.Tensor] = []
        self.kinds: list[str] = []  # "tensor", or the Python type a number came as
        self.free: list[int] = []  # each tensor's size along the free dimension (-1: none)
        self.signature: list[str] = []  # what must agree, entry by entry
        self.summary: list[tuple[str, str]] = []  # (where, what): readable, with free sizes
        self.data = False  # holds plain Python data (per-sample lists, values)
        self.values: list[str] = []  # paths of bare values (not a tensor, list or None)
        self.skeleton: Any = None

    @functools.cached_property
    def digest(self) -> int:
        """A 64-bit hash of the signature (read once the walk is done)."""
        text = "\n".join(self.signature).encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big", signed=True)

    def _note(self, signature: str, path: str, what: str) -> None:
        self.signature.append(signature)
        self.summary.append((path or "the input", what))

    def walk(self, obj: Any, path: str) -> Any:
        """Record ``obj`` and return its skeleton (tensors replaced by slots)."""
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, path, "tensor")
        if self.numbers and isinstance(obj, (bool, int, float)):
            try:  # floats keep Python's precision; ints beyond int64 fall through to values
                as_tensor = torch.tensor(obj, dtype=torch.float64 if isinstance(obj, float)
                                         else None)
            except (RuntimeError, OverflowError):
                pass
            else:
                return self._tensor(as_tensor, path, type(obj).__name__)
        if obj is None:
            self._note(f"{path} None", path, "None")
            return None
        name = type(obj).__qualname__
        if isinstance(obj, Mapping):
            self._note(f"{path} {name} keys {[repr(k) for k in obj]}", path,
                       f"a {name} with keys {list(obj)}")
            return rebuild_mapping(obj, {k: self.walk(v, f"{path}[{k!r}]") for k, v in obj.items()})
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
            self._note(f"{path} {name}", path, f"a {name}")
            return type(obj)(*(self.walk(v, f"{path}.{f}") for f, v in zip(
                obj._fields, obj, strict=True)))
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            self._note(f"{path} {name}", path, f"a {name}")
            new = copy.copy(cast(Any, obj))
            for f in dataclasses.fields(obj):
                object.__setattr__(new, f.name, self.walk(getattr(obj, f.name), f"{path}.{f.name}"))
            return new
        if isinstance(obj, (list, tuple)):
            if self.batches and not holds(obj, torch.Tensor):
                self.data = True
                self._note(f"{path} batch {name}", path, f"a {name} of {len(obj)} objects")
                return obj
            self._note(f"{path} {name} of {len(obj)}", path, f"a {name} of {len(obj)}")
            items = [self.walk(v, f"{path}[{i}]") for i, v in enumerate(obj)]
            return items if type(obj) is list else rebuild_sequence(obj, items)
        self.data = True
        self.values.append(path or "the input")
        self._note(f"{path} value", path, f"a {name} {_short(obj)}")
        return obj

    def _tensor(self, t: torch.Tensor, path: str, kind: str) -> Slot:
        if hasattr(t, "placements") and hasattr(t, "full_tensor"):  # a DTensor: refused locally
            raise ConfigurationError(
                f"{self.name} got a DTensor at {path or 'the input'} (a value computed from a "
                "sharded or tensor-parallel parameter, spread over the ranks): pass "
                "x.full_tensor() for its whole value (the same on every rank) or x.to_local() "
                "for this rank's part.")
        shape = list(t.shape)
        free = self.free_dim
        if free is None:
            self.free.append(-1)
        elif free == 0 and t.dim() == 0 and not self.sizes_free:  # gather: one row
            self.free.append(1)
        elif -t.dim() <= free < t.dim():
            d = free % t.dim()
            self.free.append(shape[d])
            shape[d] = -1  # free: may differ between ranks
        else:
            self.free.append(-1)
        if self.sizes_free:
            shape = [-1] * len(shape)
        dtype = str(t.dtype).removeprefix("torch.")
        where = "" if t.device.type == "cpu" else f" on {t.device}"
        what = f"a Python {kind}" if kind != "tensor" else f"{tuple(t.shape)} {dtype}{where}"
        self._note(f"{path} {kind} {dtype} {shape} {self.travel(t)}", path, what)
        self.tensors.append(t)
        self.kinds.append(kind)
        return Slot(len(self.tensors) - 1, kind)


def describe(obj: Any, call: str, *, free_dim: int | None, batches: bool,
             numbers: bool = False, travel: Callable[[torch.Tensor], str],
             sizes_free: bool = False) -> Described:
    """Walk ``obj`` once: its tensors, their free sizes, its signature and its skeleton."""
    described = of_call(call, free_dim=free_dim, batches=batches, numbers=numbers,
                        travel=travel, sizes_free=sizes_free)
    described.skeleton = described.walk(obj, "")
    return described


def of_call(call: str, name: str = "", *, free_dim: int | None = None, batches: bool = False,
            numbers: bool = False, travel: Callable[[torch.Tensor], str] = lambda t: "",
            sizes_free: bool = False) -> Described:
    """The description of a call alone (``call``: the function and the arguments that must
    agree); ``name`` heads its error messages (default: ``call``)."""
    described = Described(free_dim, batches, numbers, travel, name or call, sizes_free)
    described.signature.append(call)  # a rank in another call differs here
    described.summary.append(("the call", call))
    return described


def _short(obj: Any) -> str:
    try:
        text = repr(obj)
    except Exception:  # a broken __repr__ must not stop one rank before the exchange
        return "(unprintable)"
    return text if len(text) <= 30 else text[:27] + "..."


class Exchanged:
    """What the header exchange told every rank: free sizes, flags, skeletons with data."""

    def __init__(self, free: list[list[int]], flags: list[int],
                 skeletons: list[Any] | None) -> None:
        self.free = free
        self.flags = flags
        self.skeletons = skeletons  # every rank's skeleton, when the input holds Python data


def header(job: Job, described: Described, device: torch.device, advice: str, *,
           flags: int = 0, nbytes: int = 0, inline: list[int] | None = None) -> list[list[int]]:
    """The first message of every collective: every rank's header, in rank order.

    One all_gather of ``HEADER`` int64s: the magic number, the hash of the rank's description,
    its number of tensors, ``flags``, ``nbytes`` (what the call sends next, or -1 for a rank
    that cannot send it) and up to ``INLINE`` more values (``inline``). When the ranks' first
    three differ, every rank raises :class:`DistributedError` (see :func:`mismatch`).
    """
    values = inline or []
    row = [_MAGIC, described.digest, len(described.tensors), flags, nbytes, *values]
    rows = gather_ints(row + [0] * (HEADER - len(row)), device, job.world_size)
    if any(r[:3] != rows[0][:3] for r in rows) or rows[0][0] != _MAGIC:
        mismatch(job, described, advice)
    return rows


def gather_ints(values: list[int], device: torch.device, world: int) -> list[list[int]]:
    """Every rank's ``values`` (same length on all ranks), in rank order: one all_gather."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine)
    return [p.tolist() for p in parts]


def gather_bytes(payload: bytes, sizes: list[int], device: torch.device) -> list[bytes]:
    """Every rank's ``payload`` (``sizes``: their lengths, from the header): one all_gather."""
    mine = torch.zeros(max(max(sizes), 1), dtype=torch.uint8, device=device)
    if payload:
        mine[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    parts = [torch.empty_like(mine) for _ in sizes]
    dist.all_gather(parts, mine)
    return [p[:n].cpu().numpy().tobytes() for p, n in zip(parts, sizes, strict=True)]


def pickled(obj: Any) -> tuple[bytes, str]:
    """``obj`` pickled, or why it cannot be (every rank must still take part, then raise)."""
    try:
        return pickle.dumps(obj), ""
    except Exception as exc:
        return b"", f"{type(exc).__name__}: {exc}"


def exchange(job: Job, described: Described, call: str, flags: int,
             device: torch.device, advice: str) -> Exchanged:
    """The header, carrying the free sizes; raises :class:`DistributedError` on a mismatch.

    With Python data, the skeletons follow in one more all_gather of pickled bytes (their
    lengths came in the header, which replaces all_gather_object's own exchange of sizes).
    """
    world, n = job.world_size, len(described.tensors)
    payload, problem = pickled(described.skeleton) if described.data else (b"", "")
    inline = described.free[:INLINE]
    rows = header(job, described, device, advice,
                  flags=flags | (HAS_DATA if described.data else 0),
                  nbytes=-1 if problem else len(payload), inline=inline)
    free = [row[FIXED:FIXED + len(inline)] for row in rows]
    if n > INLINE:  # the same count on every rank: the hashes agree
        rest = gather_ints(described.free[INLINE:], device, world)
        free = [a + b for a, b in zip(free, rest, strict=True)]
    if not described.data:
        return Exchanged(free, [row[3] for row in rows], None)
    failed = [r for r, row in enumerate(rows) if row[4] < 0]
    if failed:
        raise ConfigurationError(
            f"{call}: rank(s) {failed} could not pickle their Python data"
            + (f" ({problem})" if problem else "") + "; pass tensors, numbers, strings or "
            "other picklable objects."
        )
    parts = gather_bytes(payload, [row[4] for row in rows], device)
    return Exchanged(free, [row[3] for row in rows], [pickle.loads(p) for p in parts])


_DIFFERENT_CALLS = (
    "Every rank must make the same sequence of collective calls: look for one under a rank "
    "test (`if rank == 0:`) or in a loop that runs a different number of times on some ranks."
)


def mismatch(job: Any, described: Described, advice: str) -> None:
    """Every rank has seen the mismatch: trade readable descriptions, raise the same error."""
    parts: list[Any] = [None] * job.world_size
    call = described.signature[0]
    dist.all_gather_object(parts, (call, described.signature, described.summary))
    functions = {c.partition("(")[0] for c, _, _ in parts}
    raise DistributedError(
        f"rank {job.rank}: {described.name} stopped before moving any data, because the "
        f"ranks' calls do not fit together: {difference(parts)}. No rank got a result.\n"
        f"{listing(parts)}\n{_DIFFERENT_CALLS if len(functions) > 1 else advice}"
    )
Summary = tuple[str, list[str], list[tuple[str, str]]]


def difference(parts: list[Summary]) -> str:
    """The first place where the ranks' descriptions differ, in words."""
    if len({call for call, _, _ in parts}) > 1:
        return "the ranks are in different calls (" + ", ".join(
            f"rank {r}: {call}" for r, (call, _, _) in enumerate(parts)) + ")"
    longest = max(len(sig) for _, sig, _ in parts)
    for i in range(longest):
        if len({sig[i] if i < len(sig) else None for _, sig, _ in parts}) > 1:
            where = next(summary[i][0] for _, sig, summary in parts if i < len(sig))
            said = [summary[i][1] if i < len(summary) else "nothing more"
                    for _, _, summary in parts]
            return f"at {where}, " + ", ".join(f"rank {r} has {s}" for r, s in enumerate(said))
    return "the ranks pass different structures"


def listing(parts: list[Summary], limit: int = 8) -> str:
    """Each rank's call and input, one line per rank (long structures cut short)."""
    lines = []
    for r, (call, _, summary) in enumerate(parts):
        entries = [f"{where}: {what}" for where, what in summary[1:]]  # [0]: the call
        shown = entries[:limit] + ([f"... {len(entries) - limit} more"]
                                   if len(entries) > limit else [])
        lines.append(f"  rank {r}: {call}" + (" with " + ", ".join(shown) if shown else ""))
    return "\n".join(lines)


