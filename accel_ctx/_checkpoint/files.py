"""Checkpoint folders on disk: layout, the atomic publish protocol, and safe reading.

Layout of ``save_state(root, ...)``::

    root/
      ckpt-000007-step1200/        a complete checkpoint (the newest one wins)
        .metadata, __0_0.distcp…   torch.distributed.checkpoint: models, optimizers, schedulers
        accel_ctx.pt               what accel_ctx owns and is the same on every rank
        rank0.pt, rank1.pt…        per rank: RNG states, loader generators, partial gradients
        manifest.json              written last: every file above with its size and CRC-32
      .tmp-ckpt-000008-step1300/   a save in progress, or one that never finished: ignored
      .trash-ckpt-000004-step600/  a rotated-out checkpoint being deleted: ignored
      .save.lock                   while a save runs: who is saving (see guard)

A checkpoint is written into ``.tmp-…``; once every rank has finished (a barrier), rank 0
writes the manifest, flushes everything to disk and renames the folder to its final name in
one atomic ``rename``. Rotated-out checkpoints are renamed to ``.trash-…`` before they are
deleted, so a crash at any moment leaves only complete checkpoints under a ``ckpt-`` name; a
save that fails (a full disk) deletes its ``.tmp-…`` folder before raising.

Loading checks a checkpoint before reading anything from it: the manifest's own checksum, every
file listed with its size, no file more, and every file's CRC-32 (``find``, with the
checksums of ``sums``). A checkpoint failing any check is skipped, with a warning
naming the file, for the one before it. Rank 0 holds ``.save.lock`` for the time of a save
(``guard``).

Reading executes nothing from the checkpoint: tensors and plain data load with
``torch.load(weights_only=True)``, and DCP's ``.metadata`` pickle (which DCP itself reads with
a bare ``pickle.load``) through an unpickler that only builds DCP's metadata classes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import os
import pickle
import re
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future
from typing_extensions import override

from ..errors import CheckpointError
from .sums import Crc32Writer, Sums, file_crc32, hex32, manifest_crc32

FORMAT = 2  # 1: sizes only, without checksums (still read, unverified)
MANIFEST = "manifest.json"
SHARED = "accel_ctx.pt"
TMP, TRASH = ".tmp-", ".trash-"
_NAME = re.compile(r"^ckpt-(\d+)-step(\d+)$")
READABLE = (1, FORMAT)


def rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


def folder_name(seq: int, step: int) -> str:
    return f"ckpt-{seq:06d}-step{step}"


def seq(name: str) -> int | None:
    """The sequence number of a checkpoint folder's name (None: not one)."""
    match = _NAME.match(name.removeprefix(TMP))
    return int(match.group(1)) if match else None


# ---- writing -----------------------------------------------------------------------------------
def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems cannot open or sync a directory
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_synced(path: Path, write: Callable[[Crc32Writer], object]) -> tuple[int, int]:
    """Write a file through ``write`` and flush it to disk; its (size, CRC-32)."""
    with open(path, "wb") as f:
        out = Crc32Writer(f)
        try:
            write(out)
        except Exception as exc:
            if out.error is not None:  # the cause, not torch.save's "unexpected pos"
                raise out.error from exc
            raise
        f.flush()
        os.fsync(f.fileno())
    return out.size, out.crc


def save_torch(path: Path, obj: Any) -> tuple[int, int]:
    return write_synced(path, lambda f: torch.save(obj, f))  # type: ignore[arg-type]


def make_root(root: Path) -> None:
    if root.exists() and not root.is_dir():
        raise CheckpointError(
            f"save_state: {root} is a file, not a folder; give save_state() the folder to keep "
            "its checkpoints in."
        )
    root.mkdir(parents=True, exist_ok=True)


def begin(root: Path, step: int) -> Path:
    """Rank 0, holding the folder's lock: clear what crashed saves left, make this save's
    temporary folder."""
    seqs = [0]
    for entry in root.iterdir():
        if entry.name.startswith((TMP, TRASH)) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)  # no save is running: those are dead
        elif (number := seq(entry.name)) is not None:
            seqs.append(number)
    tmp = root / (TMP + folder_name(max(seqs) + 1, step))
    tmp.mkdir()
    return tmp


def discard(tmp: Path | None) -> None:
    """Rank 0, after a failed save: delete its temporary folder (the next save would too)."""
    if tmp is not None and tmp.name.startswith(TMP):
        shutil.rmtree(tmp, ignore_errors=True)


def publish(tmp: Path, info: dict[str, Any], keep_last: int | None, written: Sums) -> Path:
    """Rank 0, after every rank wrote its part: manifest, flush, atomic rename, rotation.

    ``written`` holds every rank's sums of the files it wrote; a file nobody reported (none
    expected) is read back for its checksum.
    """
    on_disk = {str(p.relative_to(tmp)): p for p in sorted(tmp.rglob("*")) if p.is_file()}
    lost = sorted(set(written) - set(on_disk))
    if lost:
        raise CheckpointError(f"files written for checkpoint {tmp} have vanished: {lost}")
    sums = {name: written.get(name) or file_crc32(path) for name, path in on_disk.items()}
    for name, (size, _) in sums.items():
        if on_disk[name].stat().st_size != size:
            raise CheckpointError(
                f"checkpoint file {on_disk[name]} holds {on_disk[name].stat().st_size} bytes "
                f"but {size} were written: something else writes into {tmp}"
            )
    manifest: dict[str, Any] = {
        "format": FORMAT, **info, "files": {n: s for n, (s, _) in sums.items()},
        "crc32": {n: hex32(c) for n, (_, c) in sums.items()},
    }
    manifest["manifest_crc32"] = manifest_crc32(manifest)
    write_synced(tmp / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    fsync_dir(tmp)
    final = tmp.with_name(tmp.name.removeprefix(TMP))
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if keep_last is not None:
        complete = sorted((s, p) for p in final.parent.iterdir() if (s := seq(p.name)) is not None
                          and not p.name.startswith(TMP))
        for _, old in complete[:-keep_last]:
            trash = old.with_name(TRASH + old.name)
            os.rename(old, trash)
            shutil.rmtree(trash, ignore_errors=True)
    return final


# ---- safe reading ------------------------------------------------------------------------------
def load_torch(path: Path) -> Any:
    """``torch.load(weights_only=True)`` of one of our files; errors name the file."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint file {path} is corrupt or holds more than plain tensors and data "
            f"({_reason(exc)}). Delete {path.parent} to resume from the checkpoint before it."
        ) from None


_ALLOWED = frozenset({
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
})


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata dataclasses, torch sizes/dtypes and paths; refuses anything else."""

    @override
    def find_class(self, module: str, name: str) -> Any:
        owner = sys.modules.get(module)  # never import on the checkpoint's behalf
        obj = getattr(owner, name, None) if owner is not None else None
        if (module, name) in _ALLOWED and obj is not None:
            return obj
        if module == "torch" and isinstance(obj, torch.dtype):
            return obj
        if module.startswith("torch.distributed.checkpoint.") and isinstance(obj, type) and (
            dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)
        ):
            return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


class _TrackedFileSystem(FileSystem):
    """DCP's file system, remembering the file it opened last (to name it in errors)."""

    last: str | os.PathLike[str] | None = None

    @contextlib.contextmanager
    @override
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        self.last = path
        with super().create_stream(path, mode) as stream:
            yield stream


class SafeReader(FileSystemReader):
    """DCP's file reader with a restricted metadata unpickler and errors naming the file."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.fs = self._tracked = _TrackedFileSystem()

    @override
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except Exception as exc:
            raise CheckpointError(
                f"checkpoint file {path} is corrupt or not DCP metadata ({_reason(exc)}); "
                f"nothing in it was executed. Delete {path.parent} to resume from the checkpoint "
                "before it."
            ) from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"checkpoint file {path} does not hold DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata

    @override
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        try:
            return super().read_data(plan, planner)
        except _RefusedEntry as exc:
            raise CheckpointError(f"checkpoint file {self._tracked.last}: {exc}") from None
        except Exception as exc:
            raise CheckpointError(
                f"checkpoint file {self._tracked.last} is corrupt ({_reason(exc)}). "
                f"Delete {Path(self.path)} to resume from the checkpoint before it."
            ) from None


class _RefusedEntry(CheckpointError):
    pass


def _reason(exc: BaseException) -> str:
    """The informative part of an error (torch.load's weights_only errors are long)."""
    text = str(exc)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1].split("\n\nCheck", 1)[0]
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, loading non-tensor entries with ``weights_only=True`` (DCP uses False)."""

    @override
    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        key = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:
            raise _RefusedEntry(
                f"entry {key!r} is corrupt or holds a Python object that is not plain data "
                f"({_reason(exc)}); accel_ctx loads with weights_only=True and executes "
                "nothing from a checkpoint."
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[key], obj)
        else:
            self.state_dict[key] = obj
