"""``load_state``: load the newest complete and intact checkpoint, and resume where it stopped.

The counterpart of ``save``: ``find`` picks the checkpoint, ``dcp`` loads the objects in place,
``state`` and ``rng`` restore what accel_ctx owns, and the DataLoaders resume mid-epoch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._data import position as _position
from .._data import records as _loader_records
from .._group.blame import collective
from .._kernel import state as _state
from .._options import checked, file_path, flag
from ..errors import CheckpointError
from . import rng
from . import state as owned
from .forms import param_groups

# torch.distributed.checkpoint costs most of a second to import: it is imported at the first
# load, never by ``import accel_ctx``.


@dataclass(frozen=True)
class Resumed:
    """What :func:`load_state` restored; false (``not resumed``) when there was no checkpoint.

    Examples:
        >>> from accel_ctx import load_state
        >>> resumed = load_state("no-checkpoint-here")
        >>> bool(resumed), resumed.step, resumed.epoch
        (False, 0, 0)
    """

    path: Path | None = None
    """The checkpoint folder loaded; None when nothing was loaded."""
    step: int = 0
    """``state().step`` when it was saved: optimizer steps taken."""
    epoch: int = 0
    """0-based index of the epoch to run next, for ``range(resumed.epoch, epochs)``: the one in
    progress when saved (its remaining batches come first), or the next one if the save came
    after its last batch. Read from the first DataLoader saved (named ones first); 0 if none."""
    world_size: int = 1
    """Processes that saved it."""

    def __bool__(self) -> bool:
        return self.path is not None


@collective
@checked
def load_state(directory: str | os.PathLike[str], *, required: bool = False,
               **objects: Any) -> Resumed:
    """Load the newest complete checkpoint under ``directory`` into ``objects``; all ranks call it.

    The counterpart of :func:`save_state`, called inside the same scopes before the training
    loop: models, optimizers and schedulers are loaded in place (gradients are cleared, or set
    to the saved partial ones when it was saved inside an accumulation group), the step
    counters, loss scale and RNG states are restored, and each DataLoader resumes where it
    stopped: iterating it next continues its epoch with the first batch not seen yet, in the
    same order, and later epochs shuffle as they would have. Loaders are matched by name, the
    others by the order of their first iteration. Incomplete checkpoints (a save that never
    finished) are skipped with a warning, and so are damaged ones (a file whose content does
    not match the checksum recorded when saving, a file truncated, missing or added), naming
    the file: the checkpoint before it is loaded. ``directory`` may also name one checkpoint
    folder: then an incomplete or damaged one raises ``CheckpointError``, as does finding only
    damaged checkpoints. Without any checkpoint nothing is loaded, "no checkpoint in DIR:
    starting fresh" is logged once (logger ``accel_ctx.checkpoint``) and the result is false;
    ``required=True`` raises ``CheckpointError`` instead. Works on another number of processes
    than the one that saved (ranks beyond the saved ones keep their RNG states). Every rank
    must call it, as for :func:`save_state`.

    Examples:
        >>> import tempfile, torch
        >>> from accel_ctx import load_state, save_state
        >>> folder = tempfile.mkdtemp()
        >>> model = torch.nn.Linear(2, 2)
        >>> _ = save_state(folder, model=model)
        >>> fresh = torch.nn.Linear(2, 2)
        >>> resumed = load_state(folder, model=fresh)
        >>> bool(resumed), torch.equal(fresh.weight, model.weight)
        (True, True)
    """
    from . import dcp as objs
    from . import files, find, guard

    file_path("load_state", "directory", directory)
    flag("load_state", "required", required)
    stateful, named_loaders = objs.split(objects, "load_state", ("required",))
    guard.arrive("load_state()", objects)
    stack = _state.current()
    rank, world = objs.rank_world()
    folder = find.choose(Path(directory), rank, world, required)
    if folder is None:
        return Resumed()
    shared = files.load_torch(folder / files.SHARED)
    info = shared.get("info") or find.read_manifest(folder)  # format 1 kept it there only
    saved_world = int(shared["world_size"])
    _check_names(folder, info, shared, stateful, named_loaders)
    mine = files.load_torch(folder / files.rank_file(rank)) if rank < saved_world else None
    generators = (mine or files.load_torch(folder / files.rank_file(0)))["generators"]
    if stack is not None:
        for concern in stack.concerns:  # moved or sharded as training will use them
            concern.prepare_for_load(stateful, stack.session)
    _clear_grads(stateful)
    with objs.as_stock_torch():
        objs.load(folder, stateful, shared["optimizers"], shared["plain"],
                  shared.get("optimizer_params", {}))
    counters = shared["counters"]
    owned.apply_counters(stack, counters, stateful)
    _restore_partial_grads(stack, mine, stateful, world == saved_world)
    _resume_loaders(stack, shared["loaders"], generators, named_loaders)
    if mine is not None:
        rng.restore(mine["rng"])
    return Resumed(folder, int(info["step"]), int(info["epoch"]), saved_world)


def _check_names(folder: Path, info: dict[str, Any], shared: dict[str, Any],
                 stateful: dict[str, Any], loaders: dict[str, Any]) -> None:
    saved = set(info["objects"])
    saved_loaders = {e["name"] for e in shared["loaders"] if e["name"] is not None}
    unknown = [n for n in stateful if n not in saved] + [n for n in loaders
                                                        if n not in saved_loaders]
    if unknown:
        raise CheckpointError(
            f"checkpoint {folder} holds no {', '.join(map(repr, unknown))}; it holds "
            f"{', '.join(sorted(saved)) or 'no named objects'}. Use the names given to save_state."
        )


def _clear_grads(stateful: dict[str, Any]) -> None:
    """A loaded state starts without gradients (DCP also needs none to create an empty
    optimizer state); partial ones saved inside an accumulation group are put back later."""
    for obj in stateful.values():
        if isinstance(obj, nn.Module):
            params: Any = obj.parameters()
        elif isinstance(obj, torch.optim.Optimizer):
            params = (p for group in param_groups(obj) for p in group)
        else:
            continue
        for p in params:
            p.grad = None


def _restore_partial_grads(stack: _state.Stack | None, mine: dict[str, Any] | None,
                           stateful: dict[str, Any], same_world: bool) -> None:
    """Offer the open concerns the partial gradients of a group the checkpoint was saved in."""
    if stack is None:
        return
    grads = mine["grads"] if mine is not None else {}
    kept = mine is not None and same_world and all(  # partial sums in FSDP2 were not saved
        g is not None and not owned.is_sharded(stateful[n])
        for n, g in grads.items() if isinstance(stateful.get(n), nn.Module))

    def put_back() -> None:
        for name, saved in grads.items():
            model = stateful.get(name)
            if isinstance(model, nn.Module):
                params = dict(model.named_parameters())
                for key, grad in saved.items():
                    params[key].grad = grad.to(params[key].device)

    for concern in stack.concerns:
        concern.resume_group(kept, put_back)


def _resume_loaders(stack: _state.Stack | None, entries: list[dict[str, Any]],
                    generators: list[torch.Tensor | None], named: dict[str, Any]) -> None:
    by_order = []
    for entry, generator in zip(entries, generators, strict=True):
        loader = named.get(entry["name"]) if entry["name"] is not None else None
        if loader is not None:
            _position.apply_position(loader, _loader_records.loader_record(loader), entry, generator)
        elif entry["name"] is None:
            by_order.append((entry, generator))
    if stack is not None:
        owned.PendingLoaders(stack.session, by_order, list(named.values())).install()
