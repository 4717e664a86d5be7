"""A model's and its optimizer's state under DeepSpeed, in a plain model's and optimizer's form.

``save_state``, ``load_state`` and ``resumable()`` keep one checkpoint format whatever the engine:
DCP's full form, tensors keyed by parameter name. Under DeepSpeed the weights and the optimizer's
states live in its partitions (ZeRO-3: the parameters too), so they are read and written through
DeepSpeed's fragment API (``deepspeed.utils.safe_get_full_fp32_param``,
``safe_get_full_optimizer_state`` and their setters; collective, every rank in the same order),
the fp32 master weights beside the model's own. A checkpoint of a DeepSpeed run is then a
checkpoint like any other: it resumes under DeepSpeed exactly, and loads under DDP or FSDP2.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from typing_extensions import override

_STEP = "step"


def _params(module: nn.Module) -> dict[str, nn.Parameter]:
    """The module's parameters by the names its state dict gives them (a tied one under each)."""
    return dict(module.named_parameters(remove_duplicate=False))


def model_state(module: nn.Module) -> dict[str, Any]:
    """``module``'s state dict with every parameter whole, in fp32 (DeepSpeed's master copy)."""
    from deepspeed.utils import safe_get_full_fp32_param

    params = _params(module)
    out: dict[str, Any] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        param = params.get(key)
        if param is None:
            out[key] = value.detach().clone() if isinstance(value, torch.Tensor) else value
            continue
        full = safe_get_full_fp32_param(param)
        out[key] = (full if full is not None else param).detach().clone()
    return out


def load_model_state(module: nn.Module, state: dict[str, Any]) -> None:
    """Put ``state`` into ``module``: its own tensors (ZeRO-3: its partitions, re-split from
    rank 0's values) and DeepSpeed's fp32 master copy."""
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param

    params = _params(module)
    done: set[int] = set()
    buffers = dict(module.named_buffers(remove_duplicate=False))
    for key, value in state.items():
        if key in buffers:
            buffers[key].copy_(value)
            continue
        param = params[key]
        if id(param) in done:
            continue  # tied: set once
        done.add(id(param))
        with torch.no_grad(), deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            param.data.copy_(value.to(param.dtype))
        safe_set_full_fp32_param(param, value.to(torch.float32))


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer,
                    groups: list[list[str]], zero: Any) -> dict[str, Any]:
    """``optimizer``'s state as DCP's full form gives a plain one: per parameter name its state
    tensors whole (``step`` as the optimizer keeps it), and its groups' settings with the names
    of their parameters (``groups``: those names, as the script grouped them)."""
    from deepspeed.utils import safe_get_full_optimizer_state

    _create_state(optimizer, zero)
    keys = sorted({k for s in optimizer.state.values() for k in s if k != _STEP})
    step = next((s[_STEP] for s in optimizer.state.values() if _STEP in s), None)
    params = dict(module.named_parameters())
    state: dict[str, Any] = {}
    for names in groups:
        for name in names:
            entry = {k: safe_get_full_optimizer_state(params[name], k).detach().clone()
                     for k in keys}
            if step is not None:
                entry[_STEP] = step.detach().clone() if isinstance(step, torch.Tensor) else step
            state[name] = entry
    settings = _settings(optimizer, groups)
    return {"state": state,
            "param_groups": [{**s, "params": names} for s, names in zip(settings, groups,
                                                                           strict=True)]}


def _create_state(optimizer: torch.optim.Optimizer, zero: Any) -> None:
    """A fresh engine's optimizer has no state until its first step, and a checkpoint loads
    into it: a step at lr 0 on zero gradients creates it (as DCP does for a plain optimizer)
    without changing a weight, then DeepSpeed links its fragments to it (as after a step)."""
    if not any(key != _STEP for entry in optimizer.state.values() for key in entry):
        settings = [(group, group["lr"], group["params"]) for group in optimizer.param_groups]
        flats = _flat_partitions(optimizer, zero)
        kept = [(p, p.grad) for _, p in flats]
        try:
            for group, _, params in settings:
                group["lr"], group["params"] = 0.0, list(params)
            for group, p in flats:
                if not any(p is q for q in group["params"]):
                    group["params"].append(p)  # ZeRO-3 gives them to the optimizer per step
                p.grad = torch.zeros_like(p)
            optimizer.step()  # the caller runs it as stock torch (not a training step)
        finally:
            for group, lr, params in settings:
                group["lr"], group["params"] = lr, params
            for p, grad in kept:
                p.grad = grad
    link = getattr(zero, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        link()


def _flat_partitions(optimizer: torch.optim.Optimizer, zero: Any
                     ) -> list[tuple[dict[str, Any], torch.Tensor]]:
    """(its group, each fp32 partition) the optimizer steps: ZeRO-1/2 keep them in its groups,
    ZeRO-3 in its sub-groups, handed to the optimizer only while it steps."""
    subgroups = getattr(zero, "fp32_partitioned_groups_flat", None)
    if subgroups is not None:
        return [(optimizer.param_groups[zero.sub_group_to_group_id[i]], flat)
                for i, flat in enumerate(subgroups)]
    return [(group, p) for group in optimizer.param_groups for p in group["params"]]


def load_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer,
                         groups: list[list[str]], saved: dict[str, Any]) -> None:
    """Put ``saved`` (in the form :func:`optimizer_state` gives) into DeepSpeed's partitions."""
    from deepspeed.utils import safe_set_full_optimizer_state

    params = dict(module.named_parameters())
    step: Any = None
    for name, entry in saved["state"].items():
        for key, value in entry.items():
            if key == _STEP:
                step = value
            else:
                safe_set_full_optimizer_state(params[name], value, key)
    if step is not None:
        for entry in optimizer.state.values():
            if _STEP in entry:
                current = entry[_STEP]
                entry[_STEP] = (current.copy_(step) if isinstance(current, torch.Tensor)
                                else type(current)(step))
    mine = _group_of_each(optimizer, groups)
    for index, group in enumerate(saved["param_groups"]):
        for theirs in mine[index]:
            theirs.update({k: v for k, v in group.items() if k != "params"})


def _group_of_each(optimizer: torch.optim.Optimizer, groups: list[list[str]]
                   ) -> list[list[dict[str, Any]]]:
    """Per group the script made, DeepSpeed's groups of the optimizer that hold its parameters
    (one each for ZeRO-1/2; ZeRO-3 may split a group into sub-groups, in order)."""
    if len(optimizer.param_groups) == len(groups):
        return [[g] for g in optimizer.param_groups]
    if len(groups) == 1:
        return [list(optimizer.param_groups)]
    raise NotImplementedError(
        f"DeepSpeed regrouped the optimizer's {len(groups)} parameter groups into "
        f"{len(optimizer.param_groups)}; their settings cannot be matched to the saved ones")


def _settings(optimizer: torch.optim.Optimizer, groups: list[list[str]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in ours[0].items() if k != "params"}
            for ours in _group_of_each(optimizer, groups)]


class ModelForm:
    """A model DeepSpeed trains, as checkpoints read and write it (``CheckpointForm``)."""

    def __init__(self, module: nn.Module) -> None:
        self._module = weakref.ref(module)

    def groups(self) -> list[list[torch.Tensor]]:
        return []

    def state(self) -> dict[str, Any]:
        return model_state(self._live(self._module))

    def load(self, state: dict[str, Any]) -> None:
        load_model_state(self._live(self._module), state)

    @staticmethod
    def _live(ref: weakref.ref[Any]) -> Any:
        obj = ref()
        assert obj is not None, "the engine's model is gone"
        return obj


class OptimizerForm(ModelForm):
    """The optimizer of a model DeepSpeed trains, as checkpoints read and write it."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer,
                 groups: list[list[torch.Tensor]], zero: Any) -> None:
        super().__init__(module)
        self._zero = weakref.ref(zero)  # DeepSpeed's optimizer around ``optimizer``
        self._optimizer = weakref.ref(optimizer)
        self._groups = groups
        names = {id(p): n for n, p in module.named_parameters()}
        self._names = [[names[id(p)] for p in group] for group in groups]

    @override
    def groups(self) -> list[list[torch.Tensor]]:
        return self._groups

    @override
    def state(self) -> dict[str, Any]:
        return optimizer_state(self._live(self._module), self._live(self._optimizer),
                               self._names, self._live(self._zero))

    @override
    def load(self, state: dict[str, Any]) -> None:
        load_optimizer_state(self._live(self._module), self._live(self._optimizer),
                             self._names, state)
