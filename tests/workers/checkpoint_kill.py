"""A process that saves checkpoints in a loop until it is SIGKILLed, and the check of what it left.

Started from a forkserver that has torch and accel_ctx imported already, so a trial costs a
fork instead of a Python start. Every checkpoint ``v`` holds a model whose every parameter is
``v`` and a momentum buffer of ``v`` too, so a half-written or mixed checkpoint shows.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path
from typing import Any

import torch
from torch import nn

from accel_ctx import load_state, save_state
from accel_ctx._checkpoint import dcp
from accel_ctx._checkpoint import files as checkpoint_files

_ = dcp  # imported here, in the forkserver, so a forked saver starts at once

KEEP = 2


def make() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(256, 1024), nn.Linear(1024, 256))  # about 2 MB of weights
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
    return model, opt


def fill(model: nn.Module, opt: torch.optim.Optimizer, value: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
            opt.state[p]["momentum_buffer"].fill_(value)


def loaded_value(root: Path) -> tuple[float | None, Any]:
    """Load the newest checkpoint into fresh objects; the one value it holds (None: none)."""
    model, opt = make()
    fill(model, opt, -1.0)
    resumed = load_state(root, model=model, optimizer=opt)
    if not resumed:
        return None, resumed
    tensors = [t for p in model.parameters() for t in (p, opt.state[p]["momentum_buffer"])]
    values = set(torch.cat([t.detach().flatten() for t in tensors]).unique().tolist())
    if len(values) != 1:
        raise AssertionError(f"{resumed.path} mixes values {values}")
    return values.pop(), resumed


def saver(root: str, progress: str, kill_at_call: int | None = None) -> None:
    """Resume from the newest checkpoint, then save v+1, v+2, ... until killed.

    After each save returns, ``progress`` holds the value saved. With ``kill_at_call`` the
    process SIGKILLs itself at that file-system call of the save protocol instead of waiting
    to be killed from outside (every call of it is a moment a crash may happen).
    """
    torch.set_num_threads(1)
    value, _ = loaded_value(Path(root))
    value = value or 0.0
    model, opt = make()
    if kill_at_call is not None:
        _die_at(kill_at_call)
    Path(progress + ".ready").write_text("")
    while True:
        value += 1
        fill(model, opt, value)
        save_state(root, model=model, optimizer=opt, keep_last=KEEP)
        tmp = progress + ".tmp"
        Path(tmp).write_text(str(value))
        os.replace(tmp, progress)


def _die_at(call: int) -> None:
    """SIGKILL this process at the ``call``-th write, fsync, rename or delete of a save."""
    calls = [0]

    def counted(fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == call:
                os.kill(os.getpid(), signal.SIGKILL)
            return fn(*args, **kwargs)
        return wrapper

    files: Any = checkpoint_files
    files.write_synced = counted(files.write_synced)
    files.fsync_dir = counted(files.fsync_dir)
    os.rename = counted(os.rename)  # type: ignore[method-assign]
    shutil.rmtree = counted(shutil.rmtree)  # type: ignore[assignment]
