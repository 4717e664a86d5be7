"""``save_state`` / ``load_state``: resume anywhere, bit-identical, never half-written.

Models, optimizers and other objects with ``state_dict`` go through
``torch.distributed.checkpoint`` (see ``dcp``), so W ranks' checkpoint loads on W'
ranks. What accel_ctx owns (counters, loss scale, accumulation, RNG states, loader positions)
is kept beside (``state``, ``rng``); the folder layout and the atomic publish
protocol are described in ``files``, the checksums in ``sums``, how a
load picks an intact checkpoint in ``find``, and the arrival check, the folder lock
and full-disk errors in ``guard``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import _state
from .._blame import collective
from .._warn import warn_user
from ..errors import CheckpointError, ConfigurationError
from . import rng
from . import state as owned

# torch.distributed.checkpoint costs most of a second to import: it is imported at the first
# save or load, never by ``import accel_ctx``.


@dataclass(frozen=True)
class Resumed:
    """What :func:`load_state` restored; false (``not resumed``) when there was no checkpoint.

    Example:
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
def save_state(directory: str | os.PathLike[str], *, keep_last: int | None = 3,
               **objects: Any) -> Path:
    """Save a checkpoint of the training state, atomically; call it on every rank.

    Saves the ``objects`` (models, optimizers, schedulers, anything with
    ``state_dict``/``load_state_dict``, DataLoaders) and what accel_ctx owns: step counters,
    the fp16 loss scale, accumulation counters, every rank's RNG states and each DataLoader's
    position in its epoch (loaders passed here by their name, the others this scope iterated
    by the order of their first iteration). Saved inside an accumulation group, each rank's
    partial gradients are kept too. Written into a temporary folder renamed into place only
    once every rank has finished; the newest ``keep_last`` checkpoints are kept (None: all).
    The size and CRC-32 of every file, computed as it is written, go into its manifest for
    :func:`load_state` to verify. Returns the checkpoint's folder,
    ``directory/ckpt-<seq>-step<step>``.

    Every rank must call it: called on some ranks only, it raises ``DistributedError`` naming
    the ranks that never came, after ``min(60 s, distributed(timeout=...))`` or
    ``ACCEL_CTX_ARRIVAL_TIMEOUT`` seconds. Raises ``CheckpointError`` when the disk is full
    (nothing of that save is left; the previous checkpoints are intact) and when another save
    into ``directory`` is in progress (naming its process and host; a lock left by a process
    that died is taken over).

    Example:
        >>> import tempfile, torch
        >>> from accel_ctx import save_state
        >>> model = torch.nn.Linear(2, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> save_state(tempfile.mkdtemp(), model=model, optimizer=opt).name
        'ckpt-000001-step0'
    """
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int)
                                  or keep_last < 1):
        raise ConfigurationError(
            f"save_state(keep_last={keep_last!r}): give how many checkpoints to keep (>= 1), "
            "or None to keep them all."
        )
    from . import dcp as objs
    from . import files, guard

    stateful, named_loaders = objs.split(objects, "save_state")
    guard.arrive("save_state()")
    root = Path(directory)
    stack = _state.current()
    precision = stack.effective_precision() if stack is not None else None
    if precision is not None:
        precision.flush()  # the pending scale update would otherwise wait for the next backward
    rank, world = objs.rank_world()
    step = stack.session.step if stack is not None else 0
    loaders = owned.loaders_to_save(stack, named_loaders)
    tmp: Path | None = None
    lock = guard.FolderLock(root)
    error: BaseException | None = None
    if rank == 0:
        try:
            files.make_root(root)
            lock.acquire()
            tmp = files.begin(root, step)
        except Exception as exc:  # reported to every rank by agree(), not left to hang
            error = guard.explain(exc, root)
    try:
        gathered = objs.gather((str(tmp), [owned.yielded(loader) for _, loader in loaders]))
        objs.agree(error, "create the checkpoint folder")
        tmp = Path(gathered[0][0])
        final = _write(tmp, root, (rank, world, step), keep_last, stateful, loaders, gathered,
                       sorted(objects), stack)
    except BaseException:
        if rank == 0:
            files.discard(tmp)  # every rank has stopped writing: agree() or DCP said so
        raise
    finally:
        lock.release()
    return final


def _write(tmp: Path, root: Path, where: tuple[int, int, int], keep_last: int | None,
           stateful: dict[str, Any], loaders: list[tuple[str | None, Any]],
           gathered: list[Any], names: list[str], stack: _state.Stack | None) -> Path:
    """Every rank writes its part into ``tmp``; rank 0 publishes it. ``where``: rank, world
    size and step."""
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    from . import dcp as objs
    from . import files, guard
    from .sums import ChecksumWriter

    rank, world, step = where
    counters = owned.capture_counters(stack, stateful)
    writer = ChecksumWriter(tmp)
    with objs.as_stock_torch(), objs.checkpoint_errors(tmp, "write", root):
        state_dict, forms = objs.collect(stateful)
        dcp_save(state_dict, storage_writer=writer, no_dist=not objs.collective())
    written = writer.written(tmp)
    positions = [owned.position(loader, name, [g[1][i] for g in gathered])
                 for i, (name, loader) in enumerate(loaders)]
    epoch = owned.next_epoch(positions[0]) if positions else 0
    info = {"step": step, "epoch": epoch, "world_size": world, "objects": names}
    error: BaseException | None = None
    mine = files.rank_file(rank)
    try:
        written[mine] = files.save_torch(tmp / mine, {
            "rng": rng.capture(),
            "generators": [owned.generator_state(loader) for _, loader in loaders],
            "grads": _partial_grads(counters, stateful),
        })
        if rank == 0:
            plain = {n: stateful[n].state_dict() for n, form in forms.items() if form is None}
            written[files.SHARED] = files.save_torch(tmp / files.SHARED, {
                "counters": counters, "loaders": positions, "world_size": world,
                "optimizers": forms, "plain": plain, "info": info,
                "optimizer_params": objs.optimizer_params(stateful),
            })
    except Exception as exc:
        error = guard.explain(exc, root, str(tmp))
    everyone = objs.agree(error, "write its part of the checkpoint", written)
    final = tmp.with_name(tmp.name.removeprefix(files.TMP))
    if rank == 0:
        try:
            sums = {name: sum_ for part in everyone for name, sum_ in part.items()}
            final = files.publish(tmp, info, keep_last, sums)
        except Exception as exc:  # reported to every rank by agree(), not left to hang
            error = guard.explain(exc, root, str(tmp))
    objs.agree(error, "publish the checkpoint")
    return final


def _partial_grads(counters: dict[str, Any], stateful: dict[str, Any]) -> dict[str, Any]:
    if owned.mid_group(counters) is None:
        return {}
    return {n: {k: p.grad.detach().cpu() for k, p in m.named_parameters() if p.grad is not None}
            for n, m in stateful.items() if isinstance(m, nn.Module)}


@collective
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

    Example:
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

    stateful, named_loaders = objs.split(objects, "load_state")
    guard.arrive("load_state()")
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
    _to_device(stack, stateful)
    _clear_grads(stateful)
    with objs.as_stock_torch():
        objs.load(folder, stateful, shared["optimizers"], shared["plain"],
                  shared.get("optimizer_params", {}))
    counters = shared["counters"]
    owned.apply_counters(stack, counters, stateful, _device_type(stack, stateful))
    _restore_partial_grads(stack, counters, mine, stateful, world == saved_world)
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


def _to_device(stack: _state.Stack | None, stateful: dict[str, Any]) -> None:
    """Move models where distributed() will put them, so loaded optimizer states live there."""
    device = stack.dist.device if stack is not None and stack.dist is not None else None
    if device is None or device.type == "cpu":
        return
    for obj in stateful.values():
        if isinstance(obj, nn.Module):
            tensors = [*obj.parameters(), *obj.buffers()]
            if tensors and all(t.device.type == "cpu" for t in tensors):
                obj.to(device)


def _clear_grads(stateful: dict[str, Any]) -> None:
    """A loaded state starts without gradients (DCP also needs none to create an empty
    optimizer state); partial ones saved inside an accumulation group are put back later."""
    for obj in stateful.values():
        if isinstance(obj, nn.Module):
            params: Any = obj.parameters()
        elif isinstance(obj, torch.optim.Optimizer):
            params = (p for group in obj.param_groups for p in group["params"])
        else:
            continue
        for p in params:
            p.grad = None


def _device_type(stack: _state.Stack | None, stateful: dict[str, Any]) -> str:
    if stack is not None and stack.dist is not None:
        return stack.dist.device.type
    for obj in stateful.values():
        if isinstance(obj, nn.Module):
            for p in obj.parameters():
                return p.device.type
    return "cpu"


def _restore_partial_grads(stack: _state.Stack | None, counters: dict[str, Any],
                           mine: dict[str, Any] | None, stateful: dict[str, Any],
                           same_world: bool) -> None:
    group = owned.mid_group(counters)
    acc = stack.accumulate if stack is not None else None
    if group is None or acc is None:
        return
    done, size = group
    if mine is not None and same_world and acc.steps == size:
        for name, grads in mine["grads"].items():
            model = stateful.get(name)
            if isinstance(model, nn.Module):
                params = dict(model.named_parameters())
                for key, grad in grads.items():
                    params[key].grad = grad.to(params[key].device)
        return
    warn_user(
        f"load_state: the checkpoint was saved after micro-batch {done} of an accumulation "
        f"group of {size}; those partial gradients belong to the ranks and accumulate({size}) "
        "that saved it and are dropped here, so the next group starts afresh. Save after "
        "opt.step() at a group boundary (state().sync_gradients) to resume elsewhere exactly.")
    acc.micro, acc.size, acc.sync_gradients = 0, None, True


def _resume_loaders(stack: _state.Stack | None, entries: list[dict[str, Any]],
                    generators: list[torch.Tensor | None], named: dict[str, Any]) -> None:
    by_order = []
    for entry, generator in zip(entries, generators, strict=True):
        loader = named.get(entry["name"]) if entry["name"] is not None else None
        if loader is not None:
            owned.apply_position(loader, _state.loader_record(loader), entry, generator)
        elif entry["name"] is None:
            by_order.append((entry, generator))
    if stack is not None:
        owned.PendingLoaders(stack.session, by_order, list(named.values())).install()
