"""Content checksums of checkpoint files: computed while they are written, verified before a load.

Every byte a save writes passes through a :class:`Crc32Writer` (DCP's shards and metadata
through :class:`ChecksumWriter`, our own files through ``files.write_synced``), so
the CRC-32 of each file comes from data already in memory: no file is read back. Each rank
reports the sums of the files it wrote; rank 0 puts them in the manifest. A load verifies the
newest checkpoint before anything is loaded from it: every rank reads a share of its files (the
largest first, to the least-loaded rank) and the ranks agree on the verdict, so a damaged file
sends the load to the checkpoint before it instead of into the model.

``zlib.crc32`` runs at about 3 GB/s and releases the GIL on large buffers, so a large write's
checksum is computed on a second thread while the write copies the same bytes to the page
cache; see ``benchmarks/checkpoint_speed.py`` for what it costs a save and a load.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter
from typing_extensions import override

Sums = dict[str, tuple[int, int]]
"""File name (relative to the checkpoint folder) -> (size in bytes, CRC-32)."""

_CHUNK = 1 << 24
_OVERLAP = 1 << 20  # writes this large get their checksum computed beside the write
_crc32 = zlib.crc32  # of the files' content (benchmarks/checkpoint_speed.py swaps it out)


class Crc32Writer:
    """A write-only view of a binary file updating the size and CRC-32 of what passes through."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.crc = 0
        self.size = 0
        self.error: OSError | None = None
        """The first write error: torch.save's zip writer reports it as a bare "unexpected pos"."""

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        overlap: list[int] = []
        if len(view) >= _OVERLAP:  # both release the GIL: the checksum hides behind the copy
            thread = threading.Thread(target=lambda: overlap.append(_crc32(view, self.crc)))
            thread.start()
        try:
            written = self.raw.write(view)
        except OSError as exc:
            self.error = self.error or exc
            raise
        finally:
            if len(view) >= _OVERLAP:
                thread.join()  # the caller may reuse its buffer once write() returns
        n = len(view) if written is None else written
        self.crc = overlap[0] if overlap and n == len(view) else _crc32(view[:n], self.crc)
        self.size += n
        return n

    def flush(self) -> None:
        self.raw.flush()

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False  # a seek back would make the running checksum wrong

    def close(self) -> None:
        self.raw.close()

    @property
    def closed(self) -> bool:
        return self.raw.closed


class ChecksumFileSystem(FileSystem):
    """DCP's file system, checksumming every file written and keeping the first write error."""

    def __init__(self) -> None:
        super().__init__()
        self.sums: dict[str, tuple[int, int]] = {}
        self.error: OSError | None = None

    @contextlib.contextmanager
    @override
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            writer = Crc32Writer(raw)  # type: ignore[arg-type]
            try:
                yield writer
            finally:
                self.error = self.error or writer.error
        self.sums[str(path)] = (writer.size, writer.crc)

    @override
    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        if str(path) in self.sums:  # DCP writes .metadata under a temporary name first
            self.sums[str(new_path)] = self.sums.pop(str(path))


class ChecksumWriter(FileSystemWriter):
    """DCP's file writer, recording the size and CRC-32 of every file it writes."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.fs = self.checked = ChecksumFileSystem()

    @override
    def write_data(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().write_data(*args, **kwargs)
        except Exception as exc:
            if self.checked.error is not None:  # the cause, not torch.save's "unexpected pos"
                raise self.checked.error from exc
            raise

    def written(self, folder: Path) -> Sums:
        return {str(Path(p).relative_to(folder)): s for p, s in self.checked.sums.items()}


def file_crc32(path: Path) -> tuple[int, int]:
    """(size, CRC-32) of a file: mapped, so the checksum reads the page cache without a copy."""
    crc = 0
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        try:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        except (OSError, ValueError):  # a file system without mmap: read it in chunks
            mapped = None
        if mapped is not None:
            with mapped, memoryview(mapped) as view:
                for start in range(0, size, _CHUNK):
                    crc = _crc32(view[start:start + _CHUNK], crc)
            return size, crc
        size, buffer = 0, bytearray(_CHUNK)
        with memoryview(buffer) as view:
            while n := f.readinto(buffer):
                crc = _crc32(view[:n], crc)
                size += n
    return size, crc


def hex32(crc: int) -> str:
    return f"{crc:08x}"


def manifest_crc32(manifest: dict[str, Any]) -> str:
    """The checksum of a manifest's own content (every key but this one), order-independent."""
    body = {k: v for k, v in manifest.items() if k != "manifest_crc32"}
    return hex32(zlib.crc32(json.dumps(body, sort_keys=True).encode()))


def share(files: dict[str, int], rank: int, world: int) -> list[str]:
    """The files ``rank`` verifies: largest first, each to the rank with the fewest bytes yet."""
    load = [0] * world
    mine = []
    for name in sorted(files, key=lambda n: (-files[n], n)):
        owner = min(range(world), key=lambda r: (load[r], r))
        load[owner] += files[name]
        if owner == rank:
            mine.append(name)
    return mine


def mismatches(folder: Path, names: list[str], sums: dict[str, str]) -> str | None:
    """The first of ``names`` whose content does not match its recorded checksum, described."""
    for name in names:
        path = folder / name
        try:
            _, crc = file_crc32(path)
        except OSError as exc:
            return f"checkpoint file {path} cannot be read ({exc})"
        if hex32(crc) != sums.get(name):
            return (f"checkpoint file {path} does not match its checksum (crc32 {hex32(crc)}, "
                    f"{sums.get(name)} when saved): its content changed after it was written")
    return None
