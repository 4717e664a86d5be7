"""``save_state``: every rank writes its part into a temporary folder, rank 0 publishes it.

Models, optimizers and other objects with ``state_dict`` go through
``torch.distributed.checkpoint`` (see ``dcp``), so W ranks' checkpoint loads on W' ranks. What
accel_ctx owns (counters, loss scale, accumulation, RNG states, loader positions) is kept beside
(``state``, ``rng``); the folder layout and the atomic publish protocol are described in
``files``, the checksums in ``sums``, and the arrival check, the folder lock and full-disk
errors in ``guard``. The way back is ``load``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._data import position as _position
from .._group.blame import collective
from .._kernel import state as _state
from .._options import checked, file_path
from ..errors import ConfigurationError
from . import rng
from . import stages as pipeline
from . import state as owned

# torch.distributed.checkpoint costs most of a second to import: it is imported at the first
# save or load, never by ``import accel_ctx``.


@collective
@checked
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

    Examples:
        >>> import tempfile, torch
        >>> from accel_ctx import save_state
        >>> model = torch.nn.Linear(2, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> save_state(tempfile.mkdtemp(), model=model, optimizer=opt).name
        'ckpt-000001-step0'
    """
    file_path("save_state", "directory", directory)
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int)
                                  or keep_last < 1):
        raise ConfigurationError(
            f"save_state(keep_last={keep_last!r}): give how many checkpoints to keep (>= 1), "
            "or None to keep them all."
        )
    staged = stage(Path(directory), keep_last, objects, None)
    return staged.write()


class Staged:
    """A save whose state is copied (taken at one step, every rank together): ``write()``
    writes and publishes it, on the calling thread, its collectives on ``group`` (a thread
    of its own writes while training goes on: a group of its own too)."""

    def __init__(self, root: Path, tmp: Path, lock: Any, where: tuple[int, int, int],
                 keep_last: int | None, state_dict: dict[str, Any], mine: dict[str, Any],
                 shared: dict[str, Any], group: Any) -> None:
        self.root, self.tmp, self.lock, self.where = root, tmp, lock, where
        self.keep_last, self.state_dict, self.mine, self.shared = keep_last, state_dict, mine, shared
        self.group = group

    @property
    def step(self) -> int:
        return self.where[2]

    def write(self) -> Path:
        """Every rank writes its part into the temporary folder; rank 0 publishes it."""
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        from . import dcp as objs
        from . import files, guard
        from .sums import ChecksumWriter

        rank = self.where[0]
        tmp, root = self.tmp, self.root
        try:
            writer = ChecksumWriter(tmp)
            with objs.as_stock_torch(), objs.checkpoint_errors(tmp, "write", root):
                dcp_save(self.state_dict, storage_writer=writer, process_group=self.group,
                         no_dist=not objs.collective())
            written = writer.written(tmp)
            error: BaseException | None = None
            mine = files.rank_file(rank)
            try:
                written[mine] = files.save_torch(tmp / mine, self.mine)
                if rank == 0:
                    written[files.SHARED] = files.save_torch(tmp / files.SHARED, self.shared)
            except Exception as exc:
                error = guard.explain(exc, root, str(tmp))
            everyone = objs.agree(error, "write its part of the checkpoint", written,
                                  self.group)
            final = tmp.with_name(tmp.name.removeprefix(files.TMP))
            if rank == 0:
                try:
                    sums = {name: sum_ for part in everyone for name, sum_ in part.items()}
                    final = files.publish(tmp, self.shared["info"], self.keep_last, sums)
                except Exception as exc:  # reported to every rank by agree()
                    error = guard.explain(exc, root, str(tmp))
            objs.agree(error, "publish the checkpoint", None, self.group)
        except BaseException:
            if rank == 0:
                files.discard(tmp)  # every rank has stopped writing: agree() or DCP said so
            raise
        finally:
            self.lock.release()
        return final


def stage(root: Path, keep_last: int | None, objects: dict[str, Any], group: Any) -> Staged:
    """Take the save's copy of the state now, every rank together (collectives on ``group``);
    the folder it goes to is created and locked. Nothing is written yet."""
    from . import dcp as objs
    from . import files, guard

    stateful, named_loaders = objs.split(objects, "save_state", ("keep_last",))
    guard.arrive("save_state()", objects)
    stack = _state.current()
    for concern in stack.concerns if stack is not None else ():
        concern.before_checkpoint()  # e.g. fp16's pending scale update
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
        # a pipeline's stages each know their part of the optimizers' names: gathered too
        stages = pipeline.stages()
        names = objs.optimizer_params(stateful) if stages > 1 or rank == 0 else {}
        gathered = objs.gather((str(tmp), [_position.yielded(loader) for _, loader in loaders],
                                names if stages > 1 else None), group)
        objs.agree(error, "create the checkpoint folder", None, group)
        tmp = Path(gathered[0][0])
        counters = owned.capture_counters(stack, stateful)
        with objs.as_stock_torch(), objs.checkpoint_errors(tmp, "write", root):
            state_dict, forms = objs.collect(stateful)
        positions = [_position.position(loader, name, [g[1][i] for g in gathered])
                     for i, (name, loader) in enumerate(loaders)]
        pending = owned.still_pending(stack)
        positions += [entry for entry, _ in pending]
        epoch = _epoch(stack, loaders, positions)
        info = {"step": step, "epoch": epoch, "world_size": world, "objects": sorted(objects)}
        mine = {"rng": rng.capture(),
                "generators": [*(_position.generator_state(loader) for _, loader in loaders),
                               *(generator for _, generator in pending)],
                "grads": _partial_grads(stack, stateful)}
        shared: dict[str, Any] = {}
        if rank == 0:
            plain = {n: stateful[n].state_dict() for n, form in forms.items() if form is None}
            shared = {"counters": counters, "loaders": positions, "world_size": world,
                      "optimizers": forms, "plain": plain, "info": info,
                      "optimizer_params": pipeline.joined(
                          [names, *(g[2] for g in gathered[1:])], stages)}
        state_dict, mine, shared = copy_tree((state_dict, mine, shared))
    except BaseException:
        if rank == 0:
            files.discard(tmp)
        lock.release()
        raise
    return Staged(root, tmp, lock, (rank, world, step), keep_last, state_dict, mine, shared,
                  group)


def copy_tree(tree: Any) -> Any:
    """A copy of ``tree`` whose tensors are copies on the CPU (sharded tensors stay sharded:
    their local shard is copied) and whose dicts, lists and tuples are new, so training may
    go on while it is written. Other values are kept as they are (never copied by pickling:
    that could run code)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, DTensor):
        local = tree.to_local().detach().to("cpu", copy=True)
        return DTensor.from_local(local, tree.device_mesh, tree.placements, run_check=False,
                                  shape=tree.shape, stride=tree.stride())
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: copy_tree(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [copy_tree(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(copy_tree(v) for v in tree)
    return tree  # numbers, strings (immutable); anything else is the object's own to keep


def _partial_grads(stack: _state.Stack | None, stateful: dict[str, Any]) -> dict[str, Any]:
    """The gradients accumulated so far in an unfinished group, per model; None for a sharded
    model, whose partial sums FSDP2 holds unsharded inside its engine (the resume then warns
    and starts the group afresh instead of silently dropping them)."""
    if stack is None or all(c.mid_group() is None for c in stack.concerns):
        return {}
    return {n: None if owned.is_sharded(m) else
            {k: p.grad.detach().cpu() for k, p in m.named_parameters() if p.grad is not None}
            for n, m in stateful.items() if isinstance(m, nn.Module)}


def _epoch(stack: _state.Stack | None, loaders: list[tuple[str | None, Any]],
           positions: list[dict[str, Any]]) -> int:
    """The epoch the checkpoint is at: the loop's loader's (the one being iterated; else the
    furthest on), never a validation loader's iterated once at the start."""
    if not positions:
        return 0
    active = stack.session.driving_loader() if stack is not None else None
    for i, (_, loader) in enumerate(loaders):
        if active is not None and active.loader is loader:
            return _position.next_epoch(positions[i])
    return max(_position.next_epoch(entry) for entry in positions)
