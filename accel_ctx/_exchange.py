"""The checked first exchange of gather, gather_for_metrics and pad_across_processes.

Each rank *describes* its input before any data moves: its structure (containers, keys,
lengths), for each tensor its dtype, its number of dimensions, every size but the free one (the
dimension that may differ: gather's dim 0, pad's ``dim``) and the device it travels on, and
where it holds plain Python data. A hash of that description rides in the fixed-size header that
the call exchanges anyway (one all_gather of ``HEADER`` integers, which also carries the free
sizes of the first ``_INLINE`` tensors), so a matching call costs no extra round trip. When the
hashes differ, every rank sees it in the same header, so every rank takes the same error path:
one more exchange of the readable descriptions, then a :class:`DistributedError` naming each
rank's shapes, raised before any tensor moves (a mismatched all_gather would abort gloo with
SIGABRT or hand one rank garbage).

Plain Python data (lists of per-sample objects, numbers, strings) is gathered through the
*skeleton*: the input with each tensor replaced by a :class:`Slot`, pickled once per call; its
length rides in the header too, so the skeletons cost one more all_gather, not two.
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

from ._job import Job
from ._skeleton import Slot, holds, rebuild_mapping, rebuild_sequence
from .errors import ConfigurationError, DistributedError

_MAGIC = 0x61636378  # "accx": a header that is not ours means a different call on that rank
_FIXED = 5  # magic, hash, number of tensors, flags, bytes of pickled Python data
_INLINE = 59  # free sizes carried by the header itself; more cost one more small all_gather
HEADER = _FIXED + _INLINE
HAS_DATA = 1  # flag: the input holds plain Python data to exchange as objects
PADDING = 2  # flag (gather_for_metrics): this rank's batch is padding


class Described:
    """One rank's input, described: what must agree across ranks, and what may differ."""

    def __init__(self, free_dim: int | None, batches: bool, numbers: bool,
                 travel: Callable[[torch.Tensor], str]) -> None:
        self.free_dim = free_dim  # None: every dimension must agree (reduce)
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
        shape = list(t.shape)
        free = self.free_dim
        if free is None:
            self.free.append(-1)
        elif free == 0 and t.dim() == 0:  # gather: a 0-dim tensor is one row
            self.free.append(1)
        elif -t.dim() <= free < t.dim():
            d = free % t.dim()
            self.free.append(shape[d])
            shape[d] = -1  # free: may differ between ranks
        else:
            self.free.append(-1)
        dtype = str(t.dtype).removeprefix("torch.")
        where = "" if t.device.type == "cpu" else f" on {t.device}"
        what = f"a Python {kind}" if kind != "tensor" else f"{tuple(t.shape)} {dtype}{where}"
        self._note(f"{path} {kind} {dtype} {shape} {self.travel(t)}", path, what)
        self.tensors.append(t)
        self.kinds.append(kind)
        return Slot(len(self.tensors) - 1, kind)


def describe(obj: Any, call: str, *, free_dim: int | None, batches: bool,
             numbers: bool = False, travel: Callable[[torch.Tensor], str]) -> Described:
    """Walk ``obj`` once: its tensors, their free sizes, its signature and its skeleton."""
    described = Described(free_dim, batches, numbers, travel)
    described.signature.append(call)  # a rank in another call differs here
    described.summary.append(("the call", call))
    described.skeleton = described.walk(obj, "")
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


def gather_ints(values: list[int], device: torch.device, world: int) -> list[list[int]]:
    """Every rank's ``values`` (same length on all ranks), in rank order: one all_gather."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine)
    return [p.tolist() for p in parts]


def exchange(job: Job, described: Described, call: str, flags: int,
             device: torch.device, advice: str) -> Exchanged:
    """The one header all_gather; raises :class:`DistributedError` on every rank on a mismatch.

    With Python data, the skeletons follow in one more all_gather of pickled bytes (their
    lengths came in the header, which replaces all_gather_object's own exchange of sizes).
    """
    world, n = job.world_size, len(described.tensors)
    payload, problem = b"", ""
    if described.data:
        try:
            payload = pickle.dumps(described.skeleton)
        except Exception as exc:  # every rank must still take part, then raise
            problem = f"{type(exc).__name__}: {exc}"
    head = [_MAGIC, described.digest, n, flags | (HAS_DATA if described.data else 0),
            -1 if problem else len(payload)]
    inline = described.free[:_INLINE]
    rows = gather_ints(head + inline + [0] * (_INLINE - len(inline)), device, world)
    if any(row[:3] != rows[0][:3] for row in rows) or rows[0][0] != _MAGIC:
        mismatch(job, described, call, advice)
    free = [row[_FIXED:_FIXED + len(inline)] for row in rows]
    if n > _INLINE:  # the same count on every rank: the hashes agree
        rest = gather_ints(described.free[_INLINE:], device, world)
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
    mine = torch.zeros(max(row[4] for row in rows), dtype=torch.uint8, device=device)
    mine[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine)
    skeletons = [pickle.loads(p[:row[4]].cpu().numpy().tobytes())
                 for p, row in zip(parts, rows, strict=True)]
    return Exchanged(free, [row[3] for row in rows], skeletons)


def mismatch(job: Any, described: Described, call: str, advice: str) -> None:
    """Every rank has seen the mismatch: trade readable descriptions, raise the same error."""
    parts: list[Any] = [None] * job.world_size
    dist.all_gather_object(parts, (call, described.signature, described.summary))
    raise DistributedError(
        f"rank {job.rank}: {call} stopped before moving any data, because the ranks' calls "
        f"do not fit together: {difference(parts)}. No rank got a result.\n{listing(parts)}\n"
        f"{advice}"
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
        lines.append(f"  rank {r}: {call} with " + ", ".join(shown))
    return "\n".join(lines)


