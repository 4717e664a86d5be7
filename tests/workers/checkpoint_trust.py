"""Workers for tests/test_checkpoint_trust*.py: checkpoint calls made on one rank only, damage
found by the ranks together, a full disk on one rank, and a save holding its folder's lock."""

from __future__ import annotations

import os
import signal
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from accel_ctx import (
    distributed,
    load_state,
    save_model,
    save_state,
    state,
    wait_for_everyone,
)
from accel_ctx._checkpoint import files, find, guard, sums

from .._timeouts import scaled
from .common import MLP, params


def _error(call: Callable[[], object]) -> str:
    try:
        call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _wait_for(path: Path, seconds: float = 40.0) -> None:
    deadline = time.monotonic() + scaled(seconds)
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")  # the test fails, within its time
        time.sleep(0.02)


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    F.cross_entropy(model(torch.randn(4, 8)), torch.tensor([0, 1, 2, 0])).backward()
    opt.step()
    opt.zero_grad()


def flip_byte(path: Path, offset: int | None = None) -> None:
    """Flip one bit in the middle of ``path`` (or at ``offset``): same size, other content."""
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if offset is None else offset
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def one_rank_calls(root: str) -> dict[str, Any]:
    """On 2 ranks: save_state, save_model and load_state on rank 0 alone, then rank 1 late;
    different calls on the two ranks; then every rank saves and loads as it should (the ranks
    still agree); last, save_state on rank 0 after rank 1 left the scope."""
    # not the default 60 s (this is a spawned child); scaled: the mixed calls below must meet
    os.environ[guard.ARRIVAL_ENV] = f"{scaled(4):g}"
    out: dict[str, Any] = {"arrival": os.environ[guard.ARRIVAL_ENV]}
    folder = Path(root)
    folder.mkdir(exist_ok=True)
    with distributed(timeout=scaled(60)):
        rank = state().rank
        torch.manual_seed(0)  # the same weights on both ranks: what DCP saves once
        model = MLP()
        for n, call in enumerate([lambda: save_state(folder / "ckpt", model=model),
                                  lambda: save_model(model, folder / "model.pt"),
                                  lambda: load_state(folder / "ckpt", model=model)]):
            gave_up = folder / f"rank0-gave-up-{n}"
            if state().is_main_process:
                started = time.monotonic()
                out[f"alone{n}"] = _error(call)
                out[f"waited{n}"] = time.monotonic() - started
                gave_up.write_text("")
            else:
                _wait_for(gave_up)
                out[f"late{n}"] = _error(call)
        if rank == 0:
            out["mixed"] = _error(lambda: save_state(folder / "ckpt", model=model))
        else:
            out["mixed"] = _error(lambda: load_state(folder / "ckpt", model=model))
        # the same call with other objects: rank 1 would resume without the optimizer's state
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        objects = {"model": model, "optimizer": opt} if rank == 0 else {"model": model}
        out["other_objects"] = _error(lambda: load_state(folder / "ckpt", **objects))
        out["nothing_written"] = sorted(p.name for p in folder.iterdir())
        path = save_state(folder / "ckpt", model=model)
        fresh = MLP()
        out["loaded"] = load_state(folder / "ckpt", model=fresh).path == path and all(
            torch.equal(v, params(fresh)[k]) for k, v in params(model).items())
        if rank == 0:  # rank 1 leaves distributed() meanwhile: known at once, not at the timeout
            out["after_leaving"] = _error(lambda: save_state(folder / "ckpt", model=model))
    return out


def damage_and_full_disk(root: str) -> dict[str, Any]:
    """On 2 ranks: a file verified by rank 1 is damaged, so both fall back; rank 1's disk is
    full, so both ranks raise and nothing is left of that save."""
    out: dict[str, Any] = {}
    folder = Path(root)
    with distributed(timeout=scaled(60)):
        rank = state().rank
        torch.manual_seed(0)
        model = MLP()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        _step(model, opt)
        first = save_state(folder, model=model, optimizer=opt)
        expected = params(model)
        _step(model, opt)
        second = save_state(folder, model=model, optimizer=opt)
        wait_for_everyone()
        if rank == 0:
            manifest = find.read_manifest(second)
            victim = sums.share(manifest["files"], 1, 2)[0]  # rank 1 verifies this one
            flip_byte(second / victim)
            out["victim"] = victim
        wait_for_everyone()
        fresh = MLP()
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resumed = load_state(folder, model=fresh, optimizer=fresh_opt)
        out["fell_back"] = resumed.path == first
        out["weights"] = all(torch.equal(v, params(fresh)[k]) for k, v in expected.items())
        out["warnings"] = [str(w.message) for w in caught]
        # rank 1's part meets a full disk: a real ENOSPC from the kernel (/dev/full)
        begin = files.begin

        def trapped(root_: Path, step: int) -> Path:
            tmp = begin(root_, step)
            os.symlink("/dev/full", tmp / files.rank_file(1))
            return tmp

        files.begin = trapped  # type: ignore[assignment]
        try:
            out["full"] = _error(lambda: save_state(folder, model=model, optimizer=opt))
        finally:
            files.begin = begin  # type: ignore[assignment]
        wait_for_everyone()
        out["left"] = sorted(p.name for p in folder.iterdir())
    return out


def hold_the_lock(root: str, ready: str) -> None:
    """Save into ``root`` and stop just before publishing, holding the folder's lock, until
    killed (``ready`` is written once the lock is held)."""
    torch.set_num_threads(1)
    publish = files.publish

    def stalled(*args: Any, **kwargs: Any) -> Path:
        Path(ready).write_text(str(os.getpid()))
        time.sleep(scaled(120))  # the test kills this process long before
        os.kill(os.getpid(), signal.SIGKILL)
        return publish(*args, **kwargs)

    files.publish = stalled  # type: ignore[assignment]
    save_state(root, model=MLP())
