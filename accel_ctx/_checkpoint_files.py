"""Checkpoint folders on disk: layout, the atomic publish protocol, and safe reading.

Layout of ``save_state(root, ...)``::

    root/
      ckpt-000007-step1200/        a complete checkpoint (the newest one wins)
        .metadata, __0_0.distcp…   torch.distributed.checkpoint: models, optimizers, schedulers
        accel_ctx.pt               what accel_ctx owns and is the same on every rank
        rank0.pt, rank1.pt…        per rank: RNG states, loader generators, partial gradients
        manifest.json              written last: every file above with its size
      .tmp-ckpt-000008-step1300/   a save in progress, or one that never finished: ignored
      .trash-ckpt-000004-step600/  a rotated-out checkpoint being deleted: ignored

A checkpoint is written into ``.tmp-…``; once every rank has finished (a barrier), rank 0
writes the manifest, flushes everything to disk and renames the folder to its final name in
one atomic ``rename``. Rotated-out checkpoints are renamed to ``.trash-…`` before they are
deleted, so a crash at any moment leaves only complete checkpoints under a ``ckpt-`` name.

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
from typing import IO, Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .errors import CheckpointError

FORMAT = 1
MANIFEST = "manifest.json"
SHARED = "accel_ctx.pt"
TMP, TRASH = ".tmp-", ".trash-"
_NAME = re.compile(r"^ckpt-(\d+)-step(\d+)$")


def rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


def folder_name(seq: int, step: int) -> str:
    return f"ckpt-{seq:06d}-step{step}"


def _seq(name: str) -> int | None:
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


def write_synced(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def save_torch(path: Path, obj: Any) -> None:
    write_synced(path, lambda f: torch.save(obj, f))


def begin(root: Path, step: int) -> Path:
    """Rank 0: clear what crashed saves left, then make this save's temporary folder."""
    root.mkdir(parents=True, exist_ok=True)
    seqs = [0]
    for entry in root.iterdir():
        if entry.name.startswith((TMP, TRASH)) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)  # no save is running: those are dead
        elif (seq := _seq(entry.name)) is not None:
            seqs.append(seq)
    tmp = root / (TMP + folder_name(max(seqs) + 1, step))
    tmp.mkdir()
    return tmp


def publish(tmp: Path, info: dict[str, Any], keep_last: int | None) -> Path:
    """Rank 0, after every rank wrote its part: manifest, flush, atomic rename, rotation."""
    files = {
        str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()
    }
    manifest = {"format": FORMAT, **info, "files": files}
    write_synced(tmp / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    fsync_dir(tmp)
    final = tmp.with_name(tmp.name.removeprefix(TMP))
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if keep_last is not None:
        complete = sorted((s, p) for p in final.parent.iterdir() if (s := _seq(p.name)) is not None
                          and not p.name.startswith(TMP))
        for _, old in complete[:-keep_last]:
            trash = old.with_name(TRASH + old.name)
            os.rename(old, trash)
            shutil.rmtree(trash, ignore_errors=True)
    return final


# ---- finding and validating ------------------------------------------------------------------
def validate(folder: Path) -> dict[str, Any]:
    """The manifest of a complete checkpoint; CheckpointError saying what is missing otherwise."""
    try:
        manifest: dict[str, Any] = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{folder} has no {MANIFEST}: its save never finished") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{folder / MANIFEST} is unreadable ({exc})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{folder} has checkpoint format {manifest.get('format')!r}; this accel_ctx reads "
            f"format {FORMAT}. Load it with the accel_ctx version that wrote it."
        )
    for name, size in manifest["files"].items():
        path = folder / name
        actual = path.stat().st_size if path.is_file() else None
        if actual != size:
            what = "is missing" if actual is None else f"has {actual} bytes, not {size}"
            raise CheckpointError(f"checkpoint file {path} {what} (truncated or deleted)")
    return manifest


def newest(root: Path) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint under ``root`` (or ``root`` itself) and what was skipped."""
    if (root / MANIFEST).exists() or _seq(root.name) is not None:
        validate(root)  # asked for this one: an error, not a silent fallback
        return root, []
    if not root.is_dir():
        return None, []
    skipped = [f"{p} (a save that never finished)" for p in sorted(root.iterdir())
               if p.name.startswith(TMP) and p.is_dir()]
    candidates = sorted(((s, p) for p in root.iterdir() if (s := _seq(p.name)) is not None
                         and not p.name.startswith(TMP)), reverse=True)
    for _, folder in candidates:
        try:
            validate(folder)
        except CheckpointError as exc:
            skipped.append(str(exc))
            continue
        return folder, skipped
    return None, skipped


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
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        self.last = path
        with super().create_stream(path, mode) as stream:
            yield stream


class SafeReader(FileSystemReader):
    """DCP's file reader with a restricted metadata unpickler and errors naming the file."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.fs = self._tracked = _TrackedFileSystem()

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
