"""Do the replica groups in a quorum run the same script and the same models?

Each group fills its own row of a small matrix (a marker, its script's content hash, its
trainable models' parameter count, element count and a hash of their names and shapes, its
``resumable()`` folder, and its first DataLoader's data set length and batch size); one
all-reduce over the groups shows every group every row. The row most groups share (the lowest
group's among equals) is the reference; a group whose row differs is named and stops with the
cause, before any gradient of another shape is averaged with its peers'.
"""

from __future__ import annotations

import hashlib
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

_CHUNK = 1 << 20  # float64 sums of a few such integers stay exact
_FIELDS = ("marker", "script", "script", "script", "tensors", "elements", "layout", "layout",
           "layout", "folder", "folder", "folder", "samples", "batch")
FINISHED = 2  # the marker of a group whose loop ended (it says so in its last check)


def _chunks(digest: bytes) -> list[int]:
    value = int.from_bytes(digest[:8], "big")
    return [(value >> (20 * i)) % _CHUNK for i in range(3)]


def _script_digest() -> bytes:
    path = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    try:
        data = path.read_bytes() if path is not None and path.is_file() else b""
    except OSError:
        data = b""
    return hashlib.sha256(data).digest()


def loader_shape(loaders: Sequence[Any]) -> tuple[int, int]:
    """The first DataLoader's data set length and batch size (0 where unknown): every group
    reads the same data set, each its own share of it."""
    loader = loaders[0] if loaders else None
    try:
        samples = len(loader.dataset) if loader is not None else 0
    except TypeError:  # an iterable data set without a length
        samples = 0
    batch = getattr(loader, "batch_size", None) if loader is not None else None
    return samples % (1 << 40), int(batch) if isinstance(batch, int) else 0


def samples_per_step(loaders: Sequence[Any], world: int) -> int | None:
    """The samples one group trains in one step (its first DataLoader's batch size on each of
    its ``world`` processes); None where no DataLoader with a batch size was met."""
    batch = loader_shape(loaders)[1]
    return batch * world if batch else None


def own_row(models: list[nn.Module], folder: str | None, loaders: Sequence[Any] = (),
            finished: bool = False) -> list[int]:
    """This group's fingerprint: script, its trainable models' layout, its resumable() folder,
    its data; ``finished``: its loop ended (the marker says so). (Its number of processes is in
    its torchft replica id: groups of other sizes never meet in a collective.)"""
    params = [(name, tuple(p.shape)) for m in models for name, p in m.named_parameters()
              if p.requires_grad]
    layout = hashlib.sha256(repr(params).encode()).digest()
    elements = sum(int(torch.Size(shape).numel()) for _, shape in params)
    place = hashlib.sha256(folder.encode()).digest() if folder is not None else bytes(8)
    return [FINISHED if finished else 1, *_chunks(_script_digest()), len(params),
            elements % (1 << 40), *_chunks(layout), *_chunks(place), *loader_shape(loaders)]


def fingerprints(group: int, groups: int, models: list[nn.Module], folder: str | None,
                 loaders: list[Any], allreduce: Callable[[torch.Tensor], object],
                 participants: int, finished: bool = False) -> dict[int, tuple[int, ...]]:
    """Every participating group's row, by group index (one all-reduce)."""
    table = torch.zeros(groups, len(_FIELDS), dtype=torch.float64)
    table[group] = torch.tensor(own_row(models, folder, loaders, finished),
                                dtype=torch.float64)
    allreduce(table)  # averaged over the participants: scaled back below
    rows = (table * participants).round().to(torch.int64).tolist()
    return {g: tuple(row) for g, row in enumerate(rows) if row[0] in (1, FINISHED)}


def differing(rows: dict[int, tuple[int, ...]], members: frozenset[int]) -> list[int]:
    """The groups whose row is not the reference's."""
    reference = _reference(rows, members)
    return sorted(g for g in members if g in rows and rows[g] != reference)


def _reference(rows: dict[int, tuple[int, ...]], members: frozenset[int]) -> tuple[int, ...]:
    counts = Counter(rows[g] for g in sorted(members) if g in rows)
    best = max(counts.values())
    return next(rows[g] for g in sorted(members) if g in rows and counts[rows[g]] == best)


def message(group: int, rows: dict[int, tuple[int, ...]], members: frozenset[int]) -> str:
    """Why ``group`` cannot train with the others, and the fix."""
    reference = _reference(rows, members)
    like = min(g for g in members if rows.get(g) == reference)
    mine = rows[group]
    what = []
    if mine[1:4] != reference[1:4]:
        what.append("another script (its file's contents differ)")
    if mine[4:9] != reference[4:9]:
        what.append(f"other trainable parameters ({mine[4]} tensors, {mine[5]} elements, "
                    f"against {reference[4]} and {reference[5]})")
    if not what and mine[12:14] != reference[12:14]:
        return (f"replica group {group} reads another data set than replica group {like} (its "
                f"first DataLoader: {mine[12]} samples in batches of {mine[13]}, against "
                f"{reference[12]} in batches of {reference[13]}): each group trains its share "
                "of one data set. Start every replica group with the same data and arguments.")
    if what:
        return (f"replica group {group} runs {' and '.join(what)} than replica group {like}: "
                "its gradients cannot be averaged with theirs. Start every replica group with "
                "the same script, arguments and model.")
    return (f"replica group {group} keeps its resumable() checkpoints in another folder than "
            f"replica group {like}: one healthy group writes the job's checkpoints, and a job "
            "that lost every group resumes from them, so every group must name the same folder "
            "(on storage all of them reach), without the group's index in its path.")
