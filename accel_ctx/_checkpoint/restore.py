"""The checkpoint a ``resumable()`` run starts from, handing each object its state as it is met.

``load_state`` loads everything at once, before the loop; a resumable run meets its objects one
by one (a model at its first forward, an optimizer at its first step, ...), so the checkpoint
is opened once, at the scope's entry, and each object is loaded by its key when it comes (one
DCP load of that object alone, on every rank together). The same pieces as ``load_state``:
``find`` picks the newest intact checkpoint, ``dcp`` loads, ``state`` and ``rng`` restore what
accel_ctx owns, loader positions wait for their loader's next ``iter()``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._kernel import state as _state
from ..errors import CheckpointError
from . import dcp as objs
from . import files, find, rng
from . import load as _load
from .forms import param_groups

META = "resumable"


class Meta:
    """The run's own entry: the script that wrote it and the plain values tracked."""

    def __init__(self, script: str) -> None:
        self.script = script
        # the script's resolved path and content hash: a copy elsewhere is another run
        self.path, self.digest = script_identity()
        self.keys: set[str] | None = None  # an old checkpoint's entries: the template's keys
        self.values: dict[str, Any] = {}
        self.next_epoch = 0  # of run.epochs(): the one under way, or the next once it ended
        self.finished = False  # saved as the scope ended normally
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        out = {"script": self.script, "values": json.dumps(self.values),
               "epoch": self.next_epoch, "finished": int(self.finished),
               "script_path": self.path, "script_hash": self.digest}
        return out if self.keys is None else {k: v for k, v in out.items() if k in self.keys}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = dict(state)


def script_name() -> str:
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path:
        return Path(path).name
    spec = getattr(main, "__spec__", None)
    return str(getattr(spec, "name", None) or "<interactive>")


def script_identity() -> tuple[str, str]:
    """(resolved path, sha256 of the content) of the script run; ("", "") without a file."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    try:
        resolved = Path(path).resolve() if path else None
        return (str(resolved), hashlib.sha256(resolved.read_bytes()).hexdigest()) \
            if resolved is not None else ("", "")
    except OSError:
        return "", ""


def check_script(folder: Path, meta: Meta, loaded: dict[str, Any]) -> str | None:
    """Refuse a checkpoint another script wrote; the warning for the same script moved."""
    saved, path, digest = loaded.get("script"), loaded.get("script_path"), loaded.get("script_hash")
    fix = (f"A folder holds one script's run: give this script a folder of its own, or move "
           f"{folder} away to start afresh.")
    if path and meta.path and path != meta.path:  # the same path, edited: a fix and restart
        if digest != meta.digest:
            raise CheckpointError(
                f"resumable({folder}): its checkpoints were written by the script {path}, and "
                f"this is {meta.path}, with other contents: another experiment. {fix}")
        return (f"resumable({folder}): its checkpoints were written by {path}; this is the "
                f"same script at {meta.path} (moved or copied): resuming.")
    if not path and saved is not None and saved != meta.script:  # an older checkpoint
        raise CheckpointError(
            f"resumable({folder}): its checkpoints were written by the script {saved!r}, and "
            f"this is {meta.script!r}. {fix}")
    return None


def load_meta(checkpoint: Checkpoint, meta: Meta) -> None:
    """Load the run's record; a checkpoint written before a key existed loads without it."""
    saved = files.SafeReader(checkpoint.folder).read_metadata().state_dict_metadata
    meta.keys = {k[len(META) + 1:] for k in saved if k.startswith(META + ".")}
    try:
        checkpoint.load(META, meta, {}, "the run's own record")
    finally:
        meta.keys = None


class Checkpoint:
    """One checkpoint folder, opened for a resumable run on ``rank`` of ``world``."""

    def __init__(self, folder: Path, rank: int, world: int) -> None:
        self.folder, self.rank, self.world = folder, rank, world
        # The newest checkpoint published since (None: none), asked at a load: it carries the
        # entries not met again, and this one may be rotated out by keep_last meanwhile.
        self.follow: Callable[[], Path | None] | None = None
        self._newer: Checkpoint | None = None
        self.shared: dict[str, Any] = files.load_torch(folder / files.SHARED)
        self.info: dict[str, Any] = self.shared.get("info") or find.read_manifest(folder)
        self.saved_world = int(self.shared["world_size"])
        self.same_world = self.saved_world == world
        self.mine: dict[str, Any] | None = (
            files.load_torch(folder / files.rank_file(rank)) if rank < self.saved_world else None)
        self.names: set[str] = set(self.info["objects"])
        self.counters: dict[str, Any] = self.shared["counters"]

    @property
    def step(self) -> int:
        return int(self.info["step"])

    @property
    def epoch(self) -> int:
        return int(self.info["epoch"])

    def restore_session(self, stack: _state.Stack) -> None:
        """The step counters: ``run.step`` is right from the scope's entry on."""
        session = stack.session
        if self.counters:
            session.forget_unread()
            (session.step, session.skipped_steps, session.backward_calls,
             session.last_counted_group) = self.counters["session"]

    def restore_loaders(self, stack: _state.Stack, named: dict[str, Any]) -> None:
        """Positions wait for their loader's next ``iter()`` (by name, else by order)."""
        generators = (self.mine or files.load_torch(self.folder / files.rank_file(0)))["generators"]
        _load._resume_loaders(stack, self.shared["loaders"], generators, named)

    def restore_process(self, stack: _state.Stack) -> None:
        """RNG streams and the open concerns' state (loss scale, accumulation counters)."""
        saved = self.counters.get("concerns", {}) if self.counters else {}
        for concern in stack.concerns:
            if concern.slot in saved:
                concern.load_state_dict(saved[concern.slot])
        if self.mine is not None:
            rng.restore(self.mine["rng"])

    def optimizer_counters(self, name: str) -> tuple[int, int, int] | None:
        found = self.counters.get("optimizers", {}).get(name) if self.counters else None
        return tuple(found) if found is not None else None

    def scheduler_counters(self, name: str) -> tuple[int, int] | None:
        found = self.counters.get("schedulers", {}).get(name) if self.counters else None
        return tuple(found) if found is not None else None

    def owners(self, name: str) -> list[str]:
        """The models an optimizer's saved state is keyed by."""
        form = self.shared["optimizers"].get(name)
        return list(form) if form else []

    def carry(self, name: str) -> Any:
        """The entry ``name`` as saved, to be saved again (``state.Carried``)."""
        from .state import Carried

        forms = self.shared["optimizers"]
        counters = {kind: self.counters[kind][name] for kind in ("optimizers", "schedulers")
                    if self.counters and name in self.counters.get(kind, {})}
        optimizer = name in forms
        form = forms[name] if optimizer else ...
        state = objs.read_entry(self.folder, name) if not optimizer or form else None
        return Carried(state, form, self.shared["plain"].get(name),
                       self.shared.get("optimizer_params", {}).get(name), counters)

    def load(self, name: str, obj: Any, others: dict[str, Any], what: str) -> None:
        """Load ``obj``, saved as ``name``; ``others``: its owner models (optimizers).
        ``what`` describes the object for an error ("the first model met (Net)")."""
        stateful = {**others, name: obj}
        source = self._source(name)
        grads = _stash_grads(obj)  # DCP makes a missing optimizer state by a zero step
        try:
            with objs.as_stock_torch():
                objs.load(source.folder, stateful, source.shared["optimizers"],
                          source.shared["plain"], source.shared.get("optimizer_params", {}),
                          only={name})
        except CheckpointError as exc:
            if not source.folder.exists():
                raise CheckpointError(
                    f"resumable({self.folder.parent}): checkpoint {source.folder.name}, which "
                    f"this run resumed from, was removed before the run met {what} "
                    f"({name!r}) again: rotated out by keep_last or deleted by hand, and no "
                    "checkpoint since carries that entry. Keep the folder's checkpoints while "
                    "a run resumed from them goes on (only resumable() rotates them), or "
                    "name the object with run.track() so that it is restored at once."
                ) from None
            raise CheckpointError(
                f"resumable({self.folder.parent}): {what} does not match the checkpoint's "
                f"{name!r}: {exc} The same script finds its objects again in the same order "
                "(models by their first forward, optimizers by their first step, schedulers by "
                "their first step(), loaders by their first iteration, the rest by name in "
                "run.track()). If the script changed, or the folder holds another run, give "
                "this run its own folder (or move the old checkpoints away)."
            ) from None
        finally:
            for param, grad in grads:
                param.grad = grad

    def _source(self, name: str) -> Checkpoint:
        newest = self.follow() if self.follow is not None else None
        if newest is None or newest == self.folder:
            return self
        if self._newer is None or self._newer.folder != newest:
            self._newer = Checkpoint(newest, self.rank, self.world)
        return self._newer if name in self._newer.names else self


def _stash_grads(obj: Any) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    if isinstance(obj, torch.optim.Optimizer):
        params = [p for group in param_groups(obj) for p in group]
    elif isinstance(obj, nn.Module):
        params = list(obj.parameters())
    else:
        return []
    kept = [(p, p.grad) for p in params]
    for p in params:
        p.grad = None
    return kept


def is_loader(obj: Any) -> bool:
    from torch.utils.data import DataLoader

    return isinstance(obj, DataLoader)


def ordinal(key: str) -> str:
    digits = key.lstrip("abcdefghijklmnopqrstuvwxyz")
    n = int(digits) + 1 if digits else 1
    suffix = {1: "st", 2: "nd", 3: "rd"}.get(n if n < 20 else n % 10, "th")
    return f"{n}{suffix}"


def new_group(world: int, timeout: timedelta | None = None) -> Any:
    """A gloo group of the job's ranks for the boundary's agreement (None: one process).

    ``timeout``: the job's (``distributed(timeout=...)``); without it torch gives a new group 30
    minutes, and a rank whose peer died waits that long in the boundary's agreement."""
    if world <= 1 or not objs.collective():
        return None
    return dist.new_group(backend="gloo", timeout=timeout)


def unrestored(folder: Path, checkpoint: Checkpoint, kinds: set[str], met: set[str]) -> str | None:
    """What a run that took no step says of the entries of ``kinds`` it did not meet: they are
    restored when the loop meets them, and code after the loop (saving the model, evaluating
    it) would see what the script built."""
    unmet = sorted(name for name in checkpoint.names
                   if name.rstrip("0123456789") in kinds and name not in met)
    if not unmet:
        return None
    return (f"resumable({folder}): {', '.join(unmet)} of checkpoint {checkpoint.folder.name} "
            "were not restored: the loop took no step, so it met none of them, and after the "
            "loop they hold what the script built, not the trained state. Pass them to "
            "run.track() as you build them (e.g. run.track(net=model, opt=optimizer)) to have "
            f"them restored at once, or read them with load_state({str(folder)!r}, ...).")


def not_a_run(folder: Path, checkpoint: Checkpoint) -> CheckpointError:
    """The error of a folder whose newest checkpoint ``save_state()`` wrote, not a run."""
    held = ", ".join(sorted(checkpoint.names)) or "nothing"
    own = folder.with_name(folder.name + "-run")
    return CheckpointError(
        f"resumable({folder}): {checkpoint.folder.name} in this folder was written by "
        f"save_state() (it holds {held}, step {checkpoint.step}), not by a resumable() run: it "
        "has no run's record (the epoch under way, the script, the objects' keys), so "
        "resumable() cannot continue it as its own. Give resumable() a folder of its own "
        f"(e.g. resumable({str(own)!r})) and, to start that run from this checkpoint, "
        "load it when the run starts fresh, before the loop: `if not run.resumed: "
        f"load_state({str(folder)!r}, model=model, optimizer=optimizer)`.")
