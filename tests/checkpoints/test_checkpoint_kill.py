"""A process SIGKILLed while saving leaves the previous checkpoint intact and loadable.

Each trial forks a saver from a forkserver (torch already imported: a trial costs a fork, not
a Python start), lets it save in a loop, and SIGKILLs it at a random moment; this process then
loads the newest checkpoint and checks it is whole (every tensor holds the one value it was
saved with) and no older than the last save that returned. The next trial's saver resumes from
it. A second test kills the saver at each file-system step of the save protocol in turn.

Nothing depends on the machine's speed: a trial kills only after it saw its saver finish a save
(so every trial makes progress), at a random moment within twice the time that save took here
(so on a busy machine the moments stretch with the saves), and trials go on, boundedly, until
enough kills landed inside a save.
"""

from __future__ import annotations

import os
import random
import signal
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

from accel_ctx._checkpoint import files

from .._spawn import context as spawn_context
from .._timeouts import hint, scaled
from ..workers import checkpoint_kill

TRIALS = 20
MID_SAVE = 3  # kills that must land inside a save (a dead save's folder left behind)


@pytest.fixture(scope="module")
def forkserver() -> Any:
    # the spawn harness's server (torch, torch._dynamo that optimizers import, numpy.random
    # preloaded): one server per session whichever test starts it, so a saver starts at once
    return spawn_context()


def _start(ctx: Any, root: Path, progress: Path, kill_at: int | None = None) -> Any:
    ready = Path(str(progress) + ".ready")
    ready.unlink(missing_ok=True)
    proc = ctx.Process(target=checkpoint_kill.saver, args=(str(root), str(progress), kill_at))
    proc.start()
    deadline = time.monotonic() + scaled(60)
    while not ready.exists() and proc.is_alive():
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the saver never got ready: {hint()}")
        time.sleep(0.002)
    return proc


def _saved_past(proc: Any, progress: Path, value: float) -> None:
    """Wait until the saver has finished a save of a value above ``value``."""
    deadline = time.monotonic() + scaled(60)
    while not (progress.exists() and float(progress.read_text()) > value):
        if not proc.is_alive() or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the saver finished no save (exit code {proc.exitcode}): {hint()}")
        time.sleep(0.002)


def _check(root: Path, progress: Path, before: float | None) -> tuple[float | None, list[str]]:
    """Load as a resuming job would; the value loaded and the warnings about leftovers.

    ``before`` is what the previous check loaded: the saver resumed from it. The newest
    checkpoint must hold the last value whose save returned, or the one after it (published
    just before the kill, ``progress`` not yet updated) — never an older or a mixed one.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value, _ = checkpoint_kill.loaded_value(root)
    known = [v for v in (before, float(progress.read_text()) if progress.exists() else None)
             if v is not None]
    if known:
        assert value is not None, "a checkpoint was complete, yet nothing loads"
        assert max(known) <= value <= max(known) + 1, (value, known)
    complete = [p for p in root.iterdir() if p.name.startswith("ckpt-")] if root.exists() else []
    assert len(complete) <= checkpoint_kill.KEEP + 1  # rotation may have been cut short
    return value, [str(w.message) for w in caught]


def test_sigkill_at_random_moments_while_saving(forkserver, tmp_path):
    root, progress = tmp_path / "ckpt", tmp_path / "progress"
    rng = random.Random(1234)
    mid_save, values, value = 0, [], None
    trials = 0
    while trials < TRIALS or (mid_save < MID_SAVE and trials < 3 * TRIALS):
        trials += 1
        proc = _start(forkserver, root, progress)
        started = time.monotonic()
        _saved_past(proc, progress, value or 0.0)  # this trial makes progress
        one_save = time.monotonic() - started  # how long a save takes here, now
        time.sleep(rng.uniform(0.0, 2 * one_save))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(scaled(30))
        assert proc.exitcode == -signal.SIGKILL, f"the saver died on its own: {proc.exitcode}"
        leftovers = [p.name for p in root.iterdir() if p.name.startswith(files.TMP)] \
            if root.exists() else []
        value, warned = _check(root, progress, value)
        if leftovers:
            mid_save += 1
            assert any("never finished" in w for w in warned), warned
        values.append(value)
    assert None not in values and values == sorted(set(values))  # progress in every trial
    print("DEBUG", mid_save, trials, values)
    assert mid_save >= MID_SAVE, f"only {mid_save} of {trials} kills landed inside a save"


def test_sigkill_at_every_step_of_the_save_protocol(forkserver, tmp_path):
    root, progress = tmp_path / "ckpt", tmp_path / "progress"
    # A first saver makes KEEP + 1 checkpoints, so later saves also rotate one out.
    proc = _start(forkserver, root, progress)
    _saved_past(proc, progress, checkpoint_kill.KEEP)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(scaled(30))
    before = _check(root, progress, None)[0]
    # A save makes about ten such calls: clearing a dead save's folder, DCP's metadata rename,
    # the rank file, accel_ctx.pt, the manifest, two directory syncs, the publishing rename,
    # the rotation's rename and delete. Kill at each in turn (the next saver resumes).
    for call in range(1, 13):
        proc = _start(forkserver, root, progress, kill_at=call)
        proc.join(scaled(30))
        assert proc.exitcode == -signal.SIGKILL, (call, proc.exitcode)
        before, _ = _check(root, progress, before)
