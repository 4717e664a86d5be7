"""The first forward of a tensor-parallel model, watched for the one mistake that trains on
without an error: a 'colwise' layer's output viewed by the model's whole head count.

Each rank holds ``1/tp`` of a colwise layer's output features, whole heads of them. An attention
written ``q.view(b, t, n_heads, -1)`` then makes ``n_heads`` heads of ``head_dim / tp`` features,
a valid view of the wrong math: the model trains to another loss than in one process. (With the
head size spelled out, ``view(b, t, n_heads, head_dim)`` fails and ``explain_failure`` says why.)

Each module that declares a head count (``n_heads``, ``num_attention_heads``, ...) above a
colwise layer is watched through its first call only: a torch function mode sees the views of
that layer's output, and the hooks remove themselves after it, so later steps pay nothing.
A compiled model is not watched (the mode would be traced into its graph).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from ..errors import ConfigurationError

# attributes that count attention heads, in the modules on the way to a planned layer
HEAD_COUNTS = ("n_head", "n_heads", "num_heads", "num_attention_heads", "num_key_value_heads",
               "n_kv_heads", "num_kv_heads")
_RESHAPES = frozenset({torch.Tensor.view, torch.Tensor.reshape, torch.reshape,
                       torch.Tensor.unflatten, torch.unflatten})


def head_count(module: nn.Module) -> tuple[str, int] | None:
    """The largest head count ``module`` declares (queries: key/value counts are smaller), with
    its attribute's name; None without one."""
    counts = [(attr, count) for attr in HEAD_COUNTS
              if isinstance(count := getattr(module, attr, None), int)
              and not isinstance(count, bool) and count > 0]
    return max(counts, key=lambda found: found[1]) if counts else None


def watch_first_forward(model: nn.Module, styles: dict[str, Any], tp: int) -> None:
    """Hook each head-declaring module above a colwise layer whose output stays local."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    compiled = any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())
    if compiled or tp < 2:
        return
    owners: dict[str, list[str]] = {}
    for name, style in styles.items():
        if not (isinstance(style, ColwiseParallel) and style.use_local_output
                and style.output_layouts[0] == Shard(-1)
                and isinstance(model.get_submodule(name), nn.Linear)):
            continue
        path = name.split(".")
        for depth in range(len(path) - 1, -1, -1):  # the nearest declaring module
            owner = ".".join(path[:depth])
            if head_count(model.get_submodule(owner)) is not None:
                owners.setdefault(owner, []).append(name)
                break
    for owner, layers in owners.items():
        _Watch(model, owner, layers, tp)


class _Watch(TorchFunctionMode):
    """One head-declaring module's first call: its colwise layers' outputs, and their views."""

    def __init__(self, model: nn.Module, owner: str, layers: list[str], tp: int) -> None:
        super().__init__()
        self.module = model.get_submodule(owner)
        self.where = owner or type(model).__name__
        found = head_count(self.module)
        assert found is not None
        self.attr, self.heads = found
        self.tp = tp
        self.outputs: dict[int, tuple[torch.Tensor, str]] = {}
        self.handles: list[RemovableHandle] = [
            self.module.register_forward_pre_hook(self._enter),
            self.module.register_forward_hook(self._exit, always_call=True)]
        for layer in layers:
            sub = model.get_submodule(layer)
            self.handles.append(sub.register_forward_hook(
                lambda _m, _i, out, layer=layer: self._note(out, layer)))
        self.on = False

    def _note(self, out: Any, layer: str) -> None:
        if self.on and isinstance(out, torch.Tensor):
            self.outputs[id(out)] = (out, layer)

    def _enter(self, *_: Any) -> None:
        self.on = True
        self.__enter__()  # type: ignore[no-untyped-call]  # torch leaves it untyped

    def _exit(self, *_: Any) -> None:
        if self.on:  # also after an error (always_call): the mode never outlives the call
            self.on = False
            self.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        self.outputs.clear()
        for handle in self.handles:  # the first call only: nothing is left on later steps
            handle.remove()

    @override
    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in _RESHAPES and args and isinstance(out, torch.Tensor):
            noted = self.outputs.get(id(args[0]))
            if noted is not None and noted[0] is args[0]:
                self._check(args[0], out, noted[1])
        return out

    def _check(self, before: torch.Tensor, after: torch.Tensor, layer: str) -> None:
        local, heads, tp = before.shape[-1], self.heads, self.tp
        if (after.dim() == before.dim() + 1 and after.shape[:-2] == before.shape[:-1]
                and after.shape[-2] == heads and after.shape[-1] * heads == local):
            raise ConfigurationError(
                f"tp={tp}: {self.where} views the output of its 'colwise' layer {layer} by the "
                f"model's whole head count ({self.attr} = {heads}), as view(b, t, {heads}, -1): "
                f"each rank holds {heads // tp} of the {heads} heads ({local} of "
                f"{local * tp} features), so this makes {heads} heads of {local // heads} "
                f"features where one process has {local * tp // heads}, and the model would "
                "train to another loss without an error. Reshape by the head size, "
                "view(b, t, -1, head_dim), or by the heads this rank holds, as torchtitan "
                f"does: {self.attr} // tp ({heads // tp} here).")
