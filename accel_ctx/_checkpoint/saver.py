"""How a ``resumable()`` run writes its checkpoints: the final one, noted when it is a periodic save.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .._warn import warn_user

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
