"""A state dict saved from a ``DistributedDataParallel`` wrapper, loaded into the plain model.

A hand-written DDP script saves ``DDP(model).state_dict()``, every key behind ``module.``;
migrated, the script's model is its own module (never wrapped), so torch's ``load_state_dict``
fails with two lists of keys that do not say why. The ``load_state_dict`` gate asks here first,
inside a job, before and after the model's adoption alike (pytorch/examples' imagenet loads its
checkpoint before the first forward). Nothing is registered on the user's module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from ..errors import CheckpointError

_PREFIX = "module."


def refuse_wrapped_keys(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise a CheckpointError naming the fix if ``module.load_state_dict(*args, **kwargs)``
    would fail only because every key carries DDP's ``module.`` prefix; else return."""
    state_dict = args[0] if args else kwargs.get("state_dict")
    strict = args[1] if len(args) > 1 else kwargs.get("strict", True)
    if not strict or not isinstance(state_dict, Mapping) or not state_dict:
        return
    keys = [key for key in state_dict if isinstance(key, str)]
    if len(keys) != len(state_dict) or not all(key.startswith(_PREFIX) for key in keys):
        return
    own = {name for name, _ in module.named_parameters()}
    own.update(name for name, _ in module.named_buffers())
    if not own or own & set(keys) or not own & {key[len(_PREFIX):] for key in keys}:
        return
    raise CheckpointError(
        f"{type(module).__name__}.load_state_dict(): every key of this state dict starts with "
        f"'module.' ({keys[0]!r}): it was saved from a DistributedDataParallel wrapper "
        "(`DDP(model).state_dict()`, as a hand-written DDP script saves it), and under "
        "distributed() the model is your module itself, never wrapped. Strip the prefix before "
        "loading: `torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(state_dict, "
        "'module.')` (in place), or `{k.removeprefix('module.'): v for k, v in "
        "state_dict.items()}`.")
