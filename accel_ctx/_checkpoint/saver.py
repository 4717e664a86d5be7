"""How a ``resumable()`` run writes its checkpoints: in the background, one at a time.

**Asynchronous saves.** At the step boundary every rank takes the save's copy of the state
(``save.stage``: the state dicts, RNG states, loader positions and counters copied to the CPU,
the checkpoint's temporary folder created and locked), so the checkpoint is exactly that
step's; a thread then writes it through the same atomic, checksummed path as ``save_state``
(DCP's files, each rank's file, rank 0's publish) while training goes on. The thread's
collectives run on a gloo group of their own: on the job's default group they would interleave
with the training's (DDP's all-reduces, FSDP2's all-gathers) in a different order on each rank
and hang. DCP's own ``async_save`` was not used: its result is DCP's files only, and the
publish (every rank's files, the manifest's checksums, the atomic rename) has to follow it on
the same thread anyway. At most one save is in flight: the next one waits for it (a slow disk
delays saves, never corrupts them). A failed save warns and training goes on.

**The final checkpoint.** A run that ends on a step it has just saved does not save it again:
``finished.json`` names that checkpoint as the final one.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from .._warn import warn_user
from ..errors import DistributedError
from .preempt import Signals

FINISHED = "finished.json"  # names the final checkpoint when it was the last periodic save


def mark_finished(folder: Path, checkpoint: Path) -> None:
    """The run ended on a step just saved: instead of saving it again, note in the folder that
    this checkpoint is the final one (rank 0; a failure costs only the message)."""
    tmp = folder / f".{FINISHED}.{os.getpid()}"
    try:
        tmp.write_text(json.dumps({"checkpoint": checkpoint.name}))
        os.replace(tmp, folder / FINISHED)
    except OSError as exc:
        warn_user(f"resumable({folder}): could not note that the run finished ({exc}); "
                  "started again, it will take no step but will not say it finished.")


def marked_finished(folder: Path, checkpoint: Path) -> bool:
    """Whether ``checkpoint`` is noted as the run's final one."""
    try:
        marked = json.loads((folder / FINISHED).read_text()).get("checkpoint")
    except (OSError, ValueError, AttributeError):
        return False
    return bool(marked == checkpoint.name)


class Saver:
    """The saves of one ``resumable()`` entry: ``save()`` stages and starts writing, ``wait()``
    waits for the save in flight (``last_saved``/``last_path``: the newest published)."""

    def __init__(self, folder: Path, keep_last: int, signals: Signals) -> None:
        self.folder, self.keep_last, self.signals = folder, keep_last, signals
        self.group: Any = None  # the writer thread's own gloo group (None: one process)
        self.last_saved = -1
        self.last_path: Path | None = None
        self.last_time = time.monotonic()
        self._thread: threading.Thread | None = None
        self._result: Path | BaseException | None = None
        self._what = ""

    def save(self, objects: dict[str, Any], step: int, why: str = "", wait: bool = False,
             group: Any = None) -> Path | None:
        """Stage the state of ``step`` now (every rank, ``group``: the boundary's group) and
        write it in the background; ``wait``: until it is published. A failure warns."""
        from ..errors import CheckpointError
        from .save import stage

        self.wait()  # at most one save in flight
        self.signals.saving = True
        self._what = f"the checkpoint of step {step}{' ' + why if why else ''}"
        try:
            staged = stage(self.folder, self.keep_last, objects, group)
        except DistributedError:
            self.signals.saving = False
            raise
        except (CheckpointError, OSError) as exc:
            self.signals.saving = False
            self._warn(exc)
            return None
        finally:
            self.last_time = time.monotonic()
        staged.group = self.group

        def write() -> None:
            try:
                self._result = staged.write()
                self.last_saved = staged.step
            except BaseException as exc:  # reported by wait(), on the training's thread
                self._result = exc

        self._result = None
        self._thread = threading.Thread(target=write, daemon=True, name="accel_ctx-save")
        self._thread.start()
        return self.wait() if wait else None

    def wait(self) -> Path | None:
        """Wait for the save in flight to be published; its folder (None: none, or it failed:
        warned, or raised for a peer's failure)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return None
        thread.join()
        self.signals.saving = False
        result, self._result = self._result, None
        if isinstance(result, Path):
            self.last_path = result
            return result
        if isinstance(result, DistributedError):
            raise result
        if isinstance(result, Exception):
            self._warn(result)
        elif isinstance(result, BaseException):
            raise result
        return None

    def _warn(self, exc: BaseException) -> None:
        warn_user(f"resumable({self.folder}): {self._what} could not be saved ({exc}); "
                  "training goes on, the previous checkpoints are kept, and the next save "
                  "tries again.")
