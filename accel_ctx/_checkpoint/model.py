"""``save_model``: the plain weights in one file that loads anywhere, without accel_ctx."""

from __future__ import annotations

import contextlib
import importlib.util
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._group.blame import collective
from .._kernel import state as _state
from .._options import checked, file_path
from .._warn import warn_user
from ..errors import ConfigurationError


def _safetensors_available() -> bool:
    return importlib.util.find_spec("safetensors") is not None


@collective
@checked
def save_model(model: nn.Module, path: str | os.PathLike[str]) -> Path:
    """Write ``model``'s weights to ``path`` from rank 0, atomically; call it on every rank.

    A ``.safetensors`` path gets a safetensors file (tied weights stored once per name) when
    the ``safetensors`` package is installed; otherwise ``torch.save`` writes the state dict
    (to ``path`` with ``.pt`` in place of ``.safetensors``, with a warning, if the package is
    missing). Keys are the model's own, without ``module.`` or other wrapper prefixes, and
    sharded models are gathered first, so the file loads into a fresh model with plain
    PyTorch: ``model.load_state_dict(torch.load(path, weights_only=True))`` (a safetensors
    file: ``torch.load`` reads it from torch 2.13 on, ``safetensors.torch.load_file`` before).
    The file is written beside ``path`` and renamed into place, so ``path`` never holds half a
    model.
    Returns the path written (on every rank). Every rank must call it: called on some ranks
    only, it raises ``DistributedError`` naming the ranks that never came (see
    :func:`save_state`); a full disk raises ``CheckpointError`` saying so.

    Examples:
        >>> import tempfile, torch
        >>> from accel_ctx import save_model
        >>> model = torch.nn.Linear(2, 2)
        >>> path = save_model(model, tempfile.mkdtemp() + "/model.pt")
        >>> fresh = torch.nn.Linear(2, 2)
        >>> fresh.load_state_dict(torch.load(path, weights_only=True))
        <All keys matched successfully>
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from . import dcp as objs  # imported here: DCP is slow to import
    from .guard import arrive, explain

    if not isinstance(model, nn.Module):
        raise ConfigurationError(
            f"save_model(model=...) takes a torch.nn.Module, got {type(model).__name__}: "
            "save_model(model, 'model.safetensors').")
    file_path("save_model", "path", path)
    target = Path(path)
    if target.is_dir():  # checked on every rank: rank 0 alone would fail inside os.replace
        raise ConfigurationError(
            f"save_model(path={str(path)!r}): that is a directory, and save_model writes one "
            f"file: give a file name, e.g. save_model(model, {str(target / 'model.safetensors')!r}) "
            "(save_state(directory) keeps a whole checkpoint in a directory).")
    arrive("save_model()")
    use_safetensors = target.suffix == ".safetensors"
    if use_safetensors and not _safetensors_available():
        target, use_safetensors = target.with_suffix(".pt"), False
        if objs.rank_world()[0] == 0:
            warn_user(
                f"save_model: the safetensors package is not installed; writing a torch.save "
                f"state dict to {target} instead (pip install safetensors for {path}).")
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state_dict = _engine_state(model)  # ZeRO-3: gathered by DeepSpeed
    if state_dict is None:
        with objs.as_stock_torch():
            state_dict = get_model_state_dict(model, options=options)  # collective when sharded
    error: BaseException | None = None
    if objs.rank_world()[0] == 0:
        try:
            _write(target, state_dict, use_safetensors)
        except Exception as exc:  # reported to every rank by agree(), not left to hang
            error = explain(exc, target.parent, str(target), model_file=True)
    objs.agree(error, f"write {target}")
    return target


def _engine_state(model: nn.Module) -> dict[str, Any] | None:
    """The full state dict an engine gathers itself (DeepSpeed's ZeRO-3), or None."""
    stack = _state.current()
    for concern in stack.concerns if stack is not None else ():
        found = concern.full_model_state(model)
        if found is not None:
            return found
    return None


def _write(target: Path, state_dict: dict[str, Any], use_safetensors: bool) -> None:
    from . import files

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        if use_safetensors:
            from safetensors.torch import save as to_bytes

            data = to_bytes(_untied(state_dict, target), metadata={"format": "pt"})
            files.write_synced(tmp, lambda f: f.write(data))
        else:
            files.save_torch(tmp, state_dict)
        os.replace(tmp, target)
        files.fsync_dir(target.parent)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _untied(state_dict: dict[str, Any], target: Path) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors sharing memory and non-tensors: copy the one, drop the other."""
    out: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    dropped = [k for k, v in state_dict.items() if not isinstance(v, torch.Tensor)]
    for key, value in state_dict.items():
        if isinstance(value, torch.Tensor):
            tensor = value.detach()
            storage = tensor.untyped_storage().data_ptr()
            tied = storage in storages and tensor.numel() > 0
            storages.add(storage)
            out[key] = tensor.clone() if tied or not tensor.is_contiguous() else tensor
    if dropped:
        warn_user(f"save_model: {target} cannot hold non-tensor entries {dropped}; they are "
                      "left out.")
    return out

