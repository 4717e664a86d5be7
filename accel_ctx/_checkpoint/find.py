"""Finding the checkpoint to load: the newest one that is complete and intact.

``load_state(root)`` tries the checkpoints under ``root`` newest first. Each is checked before
anything is read from it, by every rank together (see ``sums``): rank 0 compares the
folder with its manifest (a file missing, truncated or added) and the manifest with its own
checksum, and each rank verifies the CRC-32 of its share of the files. A checkpoint failing a
check is skipped with a warning naming the file, for the one before it; when ``root`` names one
checkpoint folder, it is an error instead. When every checkpoint is damaged, the load raises
rather than start afresh (a fresh run would soon rotate them away); with none at all, it says
"no checkpoint in DIR: starting fresh" once.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from .._warn import warn_user
from ..errors import CheckpointError
from . import files
from .sums import manifest_crc32, mismatches, share


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of a checkpoint folder; CheckpointError when there is none or it is unusable."""
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint {folder} does not exist")
    try:
        manifest: dict[str, Any] = json.loads((folder / files.MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{folder} has no {files.MANIFEST}: its save never finished") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{folder / files.MANIFEST} is unreadable ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") not in files.READABLE or (
        (manifest.get("format") == files.FORMAT) != ("crc32" in manifest)
    ):
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise CheckpointError(
            f"{folder} has checkpoint format {found!r}; this accel_ctx reads formats 1 and "
            f"{files.FORMAT}. Load it with the accel_ctx version that wrote it."
        )
    return manifest


def problem(folder: Path, rank: int, world: int) -> str | None:
    """What is wrong with checkpoint ``folder`` (None: nothing), as far as ``rank`` checks.

    Rank 0 compares the folder with its manifest (missing, truncated and extra files) and the
    manifest with its own checksum; every rank verifies the content of its share of the files.
    """
    try:
        manifest = read_manifest(folder)
    except CheckpointError as exc:
        return str(exc)
    listed: dict[str, int] = manifest["files"]
    sums: dict[str, str] | None = manifest.get("crc32")
    try:
        if rank == 0:
            for name, size in listed.items():
                path = folder / name
                actual = path.stat().st_size if path.is_file() else None
                if actual != size:
                    what = "is missing" if actual is None else f"has {actual} bytes, not {size}"
                    return f"checkpoint file {path} {what} (truncated or deleted)"
            extra = sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                           if p.is_file() and p.name != files.MANIFEST)
            extra = [n for n in extra if n not in listed]
            if extra:
                return (f"checkpoint {folder} holds {', '.join(extra)}, which its save did not "
                        "write (added or renamed since)")
        if sums is None:
            return None
        damaged = mismatches(folder, share(listed, rank, world), sums)
        if damaged is None and rank == 0 and manifest.get("manifest_crc32") != manifest_crc32(
            manifest
        ):
            damaged = f"{folder / files.MANIFEST} does not match its checksum: it was changed"
        return damaged
    except (AttributeError, KeyError, TypeError, ValueError) as exc:  # a mangled manifest
        return f"{folder / files.MANIFEST} is malformed ({exc!r})"


def candidates(root: Path) -> tuple[bool, list[str], list[str]]:
    """(``root`` names one checkpoint, the checkpoints to try newest first, skipped leftovers)."""
    if root.exists() and not root.is_dir():
        raise CheckpointError(
            f"load_state: {root} is a file, not a checkpoint folder. Give load_state() the "
            "folder given to save_state() (or one ckpt-... folder inside it)."
        )
    if (root / files.MANIFEST).exists() or files.seq(root.name) is not None:
        return True, [str(root)], []  # asked for this one: an error, not a silent fallback
    if not root.is_dir():
        return False, [], []
    skipped = [f"{p} (a save that never finished: the job ended while writing it)"
               for p in sorted(root.iterdir()) if p.name.startswith(files.TMP) and p.is_dir()]
    found = sorted(((s, p) for p in root.iterdir() if (s := files.seq(p.name)) is not None
                    and not p.name.startswith(files.TMP)), reverse=True)
    return False, [str(p) for _, p in found], skipped


_log = logging.getLogger("accel_ctx.checkpoint")
_fresh_logged: set[str] = set()


def choose(root: Path, rank: int, world: int, required: bool,
           who: str = "load_state") -> Path | None:
    """The newest intact checkpoint the ranks agree on, verified by all of them together
    (``who``: the caller, for the warnings)."""
    from . import dcp as objs

    listing: tuple[bool, list[str], list[str]] = (False, [], [])
    error: BaseException | None = None
    if rank == 0:
        try:
            listing = candidates(root)
        except CheckpointError as exc:
            error = exc
        for reason in listing[2]:
            warn_user(f"{who}: ignoring incomplete checkpoint {reason}.")
    direct, folders, _ = objs.agree(error, "find a checkpoint", listing)[0]
    damaged = []
    for folder in map(Path, folders):
        problems = [p for p in objs.gather(problem(folder, rank, world)) if p is not None]
        if not problems:
            if rank == 0 and read_manifest(folder)["format"] == 1:
                warn_user(f"load_state: {folder} was saved by an older accel_ctx, without "
                              "checksums: its content cannot be verified.")
            return folder
        if direct:
            raise CheckpointError(f"{problems[0]}. Load the folder holding the checkpoints to "
                                  "take the newest intact one.")
        damaged.append(problems[0])
        if rank == 0:
            warn_user(f"load_state: skipping a damaged checkpoint: {problems[0]}. Trying the "
                          "one before it.")
    if damaged:
        raise CheckpointError(
            f"load_state: no checkpoint in {root} is intact: {'; '.join(damaged)}. Restore them "
            "from a copy, or move them away to start fresh."
        )
    if required:
        raise CheckpointError(
            f"load_state(required=True): no checkpoint in {root}. Check the folder (save_state() "
            "writes ckpt-... folders into it), or leave out required=True to start fresh."
        )
    if rank == 0 and str(root.absolute()) not in _fresh_logged:
        _fresh_logged.add(str(root.absolute()))
        _log.warning("no checkpoint in %s: starting fresh", root)
    return None
