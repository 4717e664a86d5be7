"""The objects' part of a checkpoint, through torch.distributed.checkpoint (DCP), and the ranks'
agreement around it.

Models use DCP's ``get_model_state_dict`` (plain, DDP and FSDP2 modules alike, no wrapper
prefixes); an optimizer uses ``get_optimizer_state_dict`` with the saved model(s) holding its
parameters, so its state is keyed by parameter name and reshards like the model. An optimizer
with no state yet, or saved without any of its models, is kept as ``optimizer.state_dict()``
in ``accel_ctx.pt`` instead ("plain"): DCP would first take a zero step to create its state.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.utils.data import DataLoader

from .._kernel import state as _state
from .._options import close_option, unknown_option
from ..errors import CheckpointError, ConfigurationError
from . import files
from . import forms as _forms
from . import stages as _stages
from .state import Carried


# ---- the ranks ---------------------------------------------------------------------------------
def collective() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_world() -> tuple[int, int]:
    """This rank and the world size: the job's coordinates (a group formed by hand, outside
    ``distributed()``: torch's)."""
    where = _state.coordinates()
    if where.world_size > 1:
        return where.rank, where.world_size
    return (dist.get_rank(), dist.get_world_size()) if collective() else (0, 1)


def gather(value: Any, group: Any = None) -> list[Any]:
    """Every rank's ``value`` (``group``: a group of the job's ranks, None: the default)."""
    if not collective():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value, group=group)
    return out


def agree(error: BaseException | None, what: str, value: Any = None,
          group: Any = None) -> list[Any]:
    """Every rank learns whether every rank succeeded (instead of waiting in a barrier), and
    gets every rank's ``value`` in the same exchange."""
    gathered = gather((None if error is None else repr(error), value), group)
    for rank, (message, _) in enumerate(gathered):
        if message is not None:
            if error is not None:
                raise error
            raise CheckpointError(f"rank {rank} failed to {what}: {message}")
    return [v for _, v in gathered]


@contextlib.contextmanager
def as_stock_torch() -> Iterator[None]:
    """Our own calls into torch bypass the scopes: DCP initialises an empty optimizer state by
    calling ``optimizer.step()``, which must not count as a training step. DCP's notice that a
    lone process saves alone is silenced: one process is a normal case here."""
    outer = _forms.OUTER.set(_state.current() or _forms.OUTER.get())  # engines' forms
    token = _state._STACK.set(None)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield
    finally:
        _state._STACK.reset(token)
        _forms.OUTER.reset(outer)


# ---- the objects -------------------------------------------------------------------------------
def split(objects: dict[str, Any], caller: str, options: tuple[str, ...] = ()
          ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(objects with a state_dict, DataLoaders), refusing anything else (a misspelt option
    among them: "did you mean")."""
    stateful, loaders = {}, {}
    for name, obj in objects.items():
        if isinstance(obj, DataLoader):
            loaders[name] = obj
        elif callable(getattr(obj, "state_dict", None)) and callable(
            getattr(obj, "load_state_dict", None)
        ):
            stateful[name] = obj
        elif close_option(name, options) is not None:
            raise unknown_option(caller, name, options)
        else:
            raise ConfigurationError(
                f"{caller}({name}=...): a {type(obj).__name__} has no state_dict()/"
                "load_state_dict(). Pass models, optimizers, schedulers, DataLoaders or objects "
                "with both methods."
            )
    return stateful, loaders


def _owners(optimizer: torch.optim.Optimizer, stateful: dict[str, Any]) -> list[str]:
    params = {id(p) for group in _forms.param_groups(optimizer) for p in group}
    return [n for n, m in stateful.items() if isinstance(m, nn.Module)
            and any(id(p) in params for p in m.parameters())]


def _owner_module(names: list[str], stateful: dict[str, Any], optimizer: str) -> nn.Module:
    missing = [n for n in names if not isinstance(stateful.get(n), nn.Module)]
    if missing:
        raise CheckpointError(
            f"the optimizer {optimizer!r} was saved keyed by the parameter names of "
            f"{', '.join(names)}; pass {', '.join(f'{n}=...' for n in missing)} to load_state "
            "too."
        )
    if len(names) == 1:
        return stateful[names[0]]  # type: ignore[no-any-return]
    return nn.ModuleDict({n: stateful[n] for n in names})


def collect(stateful: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the DCP state dict, per optimizer: its owner models' names or None for "plain")."""
    state_dict: dict[str, Any] = {}
    forms: dict[str, Any] = {}
    for name, obj in stateful.items():
        if isinstance(obj, Carried):  # as the checkpoint resumed from had it
            if obj.optimizer:
                forms[name] = obj.form
            if obj.state is not None:
                state_dict[name] = obj.state
        elif (engine := _forms.engine_form(obj)) is not None:  # DeepSpeed's partitions
            if isinstance(obj, torch.optim.Optimizer):
                forms[name] = _owners(obj, stateful) or None
            state_dict[name] = engine.state()
        elif isinstance(obj, nn.Module):
            state_dict[name] = get_model_state_dict(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            owners = _owners(obj, stateful)
            forms[name] = owners if owners and obj.state else None
            if forms[name]:
                state_dict[name] = get_optimizer_state_dict(
                    _owner_module(owners, stateful, name), obj,
                    options=_stages.optimizer_options(_stages.saves_flat()))
        else:
            state_dict[name] = obj.state_dict()
    return state_dict, forms


def _param_names(optimizer: torch.optim.Optimizer, module: nn.Module) -> list[list[str | None]]:
    """Per param group, the name in ``module`` of each parameter (None: not one of its)."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    names = {id(p): min(_get_fqns(module, n)) for n, p in module.named_parameters()}
    return [[names.get(id(p)) for p in group] for group in _forms.param_groups(optimizer)]


def optimizer_params(stateful: dict[str, Any]) -> dict[str, Any]:
    """For each optimizer over saved models: their names and its parameters' names in them."""
    out = {}
    for name, obj in stateful.items():
        if isinstance(obj, Carried) and obj.params is not None:
            out[name] = obj.params
        if isinstance(obj, torch.optim.Optimizer) and (owners := _owners(obj, stateful)):
            module = _owner_module(owners, stateful, name)
            out[name] = {"owners": owners, "params": _param_names(obj, module)}
    return out


def check_optimizers(folder: Path, stateful: dict[str, Any], saved: dict[str, Any]) -> None:
    """Name the parameters that differ between a saved optimizer and the one given."""
    for name, record in saved.items():
        obj, owners = stateful.get(name), record["owners"]
        if not isinstance(obj, torch.optim.Optimizer) or not all(
            isinstance(stateful.get(n), nn.Module) for n in owners
        ):
            continue  # not loaded here, or its models not passed (said elsewhere)
        given = _param_names(obj, _owner_module(owners, stateful, name))
        if given == (record["params"] if _stages.stages() == 1
                     else _stages.part_of(record["params"], given)):
            continue  # a pipeline stage loads its part of the names
        was = [n for group in record["params"] for n in group]
        now = [n for group in given for n in group]
        shapes = [tuple(p.shape) for group in _forms.param_groups(obj) for p in group]
        parts = []
        if lacking := [n for n in was if n not in now]:
            parts.append(f"lacks {_few(lacking)}")
        if extra := [n for n in now if n is not None and n not in was]:
            parts.append(f"has {_few(extra)}, which the saved one did not")
        if outside := [shapes[i] for i, n in enumerate(now) if n is None]:
            parts.append(f"has {len(outside)} parameter(s) that are not in "
                         f"{' or '.join(owners)} (shapes {_few([str(s) for s in outside])})")
        if not parts:
            parts.append(f"groups them differently: {[len(g) for g in given]} parameters per "
                         f"group, {[len(g) for g in record['params']]} when saved")
        raise CheckpointError(
            f"checkpoint {folder}: the optimizer {name!r} was saved over the parameters of "
            f"{' and '.join(owners)} ({_few(was)}); the one given {'; '.join(parts)}. Build it "
            f"over the same parameters, e.g. torch.optim.AdamW({owners[0]}.parameters()), from "
            "the same model that is passed to load_state."
        )


def load(folder: Path, stateful: dict[str, Any], forms: dict[str, Any],
         plain: dict[str, Any], params: dict[str, Any], only: set[str] | None = None) -> None:
    """Load the objects in place: DCP fills templates made from them, then they take them.

    ``only``: the names to load (the others in ``stateful`` name an optimizer's models)."""
    chosen = {n: o for n, o in stateful.items() if only is None or n in only}
    check_optimizers(folder, stateful, {n: p for n, p in params.items() if n in chosen})
    templates: dict[str, Any] = {}
    flat: dict[str, Any] = {}  # per optimizer: keyed as saved (a pipeline's: by name)
    metadata: dict[str, Any] = {}

    def saved() -> dict[str, Any]:  # the checkpoint's keys, read once, when first needed
        if not metadata:
            metadata.update(files.SafeReader(folder).read_metadata().state_dict_metadata)
        return metadata

    engines = {n: e for n, o in chosen.items() if (e := _forms.engine_form(o)) is not None}
    for name, obj in chosen.items():
        if name in engines:
            templates[name] = engines[name].state()  # DeepSpeed's, whole: DCP fills it in
        elif isinstance(obj, nn.Module):
            templates[name] = get_model_state_dict(obj)
        elif isinstance(obj, torch.optim.Optimizer) and forms.get(name) is not None:
            # with no gradients (cleared by load_state), DCP creates a missing state by a
            # zero step, so the template has every entry of the checkpoint
            module = _owner_module(forms[name], stateful, name)
            flat[name] = _stages.optimizer_options(_stages.saved_flat(saved(), name))
            templates[name] = get_optimizer_state_dict(module, obj, options=flat[name])
        elif not isinstance(obj, torch.optim.Optimizer):
            templates[name] = obj.state_dict()
    if templates:
        _check_keys(folder, saved(), templates, chosen)
        with checkpoint_errors(folder, "load"):
            dcp_load(templates, storage_reader=files.SafeReader(folder),
                     planner=files.SafeLoadPlanner(), no_dist=not collective())
    for name, obj in chosen.items():
        if name in engines:
            engines[name].load(templates[name])
        elif isinstance(obj, nn.Module):
            set_model_state_dict(obj, templates[name])
        elif isinstance(obj, torch.optim.Optimizer) and name in templates:
            set_optimizer_state_dict(_owner_module(forms[name], stateful, name), obj,
                                     templates[name], options=flat[name])
        elif isinstance(obj, torch.optim.Optimizer):
            try:
                obj.load_state_dict(plain[name])
            except (ValueError, KeyError) as exc:
                raise CheckpointError(
                    f"checkpoint {folder}: the optimizer {name!r} does not match the saved one "
                    f"({exc}). Pass an optimizer built over the same parameters."
                ) from None
        else:
            obj.load_state_dict(templates[name])


def read_entry(folder: Path, name: str) -> Any:
    """The entry ``name`` of a checkpoint as saved, with no object to load it into (tensors
    whole on this rank, whatever the world size that saved them)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    reader = files.SafeReader(folder)
    keys = {k for k in reader.read_metadata().state_dict_metadata
            if k == name or k.startswith(name + ".")}
    out: dict[str, Any] = {}
    with checkpoint_errors(folder, "load"):
        _load_state_dict(out, storage_reader=files.SafeReader(folder), no_dist=True,
                         planner=_EmptyStateDictLoadPlanner(keys=keys))  # type: ignore[no-untyped-call]
    return out.get(name)


@contextlib.contextmanager
def checkpoint_errors(folder: Path, verb: str, root: Path | None = None) -> Iterator[None]:
    """DCP reports any rank's failure on every rank as a CheckpointException (a BaseException,
    which ``except Exception`` misses): turn it into a CheckpointError naming rank and cause
    (a full disk as such when saving into ``root``)."""
    from .guard import explain

    try:
        yield
    except CheckpointException as exc:
        rank, (error, _) = min(exc.failures.items(),
                               key=lambda item: (not isinstance(item[1][0], CheckpointError),
                                                 item[0]))
        if root is not None:
            error = explain(error, root, str(folder))
        if isinstance(error, CheckpointError):
            raise CheckpointError(f"rank {rank}: {error}") from None
        raise CheckpointError(f"rank {rank} could not {verb} {folder}: {error!r}") from None


def _check_keys(folder: Path, saved: dict[str, Any], templates: dict[str, Any],
                stateful: dict[str, Any]) -> None:
    """Name the keys that differ from ``saved`` (the checkpoint's metadata) before DCP fails on
    the first one."""
    problems = []
    for name, template in templates.items():
        flat, _ = flatten_state_dict({name: template})
        cut = len(name) + 1
        missing = [k[cut:] for k in flat if k not in saved]
        unexpected = [k[cut:] for k in saved if k.startswith(name + ".") and k not in flat]
        if not isinstance(stateful[name], nn.Module) or _stages.stages() > 1:
            unexpected = []  # other objects (and pipeline stages) hold fewer entries
        shapes = [
            f"{k[cut:]} {tuple(meta.size)} in the checkpoint, {tuple(v.shape)} here"
            for k, v in flat.items()
            if isinstance(v, torch.Tensor) and isinstance(meta := saved.get(k), TensorStorageMetadata)
            and tuple(meta.size) != tuple(v.shape)
        ]
        parts = [f"{label}: {_few(keys)}" for label, keys in (
            ("missing from the checkpoint", missing), (f"not in {name}", unexpected),
            ("shapes differ", shapes)) if keys]
        if parts:
            problems.append(f"{name!r} does not match it; " + "; ".join(parts))
    if problems:
        raise CheckpointError(
            f"checkpoint {folder} was saved from different objects: " + ". ".join(problems)
            + ". Load it into the same model (architecture and sizes) that saved it."
        )


def _few(keys: list[Any], limit: int = 8) -> str:
    more = f" (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(map(str, keys[:limit])) + more
