"""Which saved entry an object a ``resumable()`` run meets is: by what it is, then by order.

A script changed between restarts, or a loop whose objects come in another order after a
resume (a frozen teacher called every 10th step, met after the student once resumed at step
15), would hand one object's state to another of the same shape without a word if keys
followed the meeting order alone. So each checkpoint keeps, beside its entries, a description
of each model (class, parameter names, shapes and which are trainable), optimizer (class, the
models it steps, its groups' sizes) and scheduler (class, its optimizer): an object met is
given the saved key whose description is its own, the meeting order deciding only among equal
ones, and the key stays that one in later saves. An object of a saved entry's class that
matches none is refused, naming both; one of no saved class is new (a fresh key, said once).
Checkpoints written before descriptions were kept are matched by order, as they were.
"""

from __future__ import annotations

import json
import weakref
from typing import Any

import torch
from torch import nn

from .._warn import warn_user
from ..errors import CheckpointError
from .forms import param_groups
from .restore import Checkpoint, ordinal

ENTRY = "resumable-keys"  # not a keyword argument: never a name given to run.track()


class Described:
    """The checkpoint's entry of descriptions (``key -> description``), saved as JSON."""

    def __init__(self) -> None:
        self.descriptions: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return {"json": json.dumps(self.descriptions, sort_keys=True)}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # pragma: no cover - read raw
        self.descriptions = json.loads(state["json"])


def _class(obj: Any) -> str:
    """The user's class (FSDP2 makes ``FSDPNet(FSDPModule, Net)`` of a sharded ``Net``)."""
    for cls in type(obj).__mro__:
        if not cls.__module__.startswith("torch.distributed"):
            return cls.__name__
    return type(obj).__name__


def describe(obj: Any, kind: str, keys: weakref.WeakKeyDictionary[Any, str]) -> dict[str, Any]:
    if kind == "model" and isinstance(obj, nn.Module):
        return {"class": _class(obj), "params": [
            [n, list(p.shape), p.requires_grad] for n, p in obj.named_parameters()]}
    if kind == "optimizer" and isinstance(obj, torch.optim.Optimizer):
        groups = param_groups(obj)  # as the script made them (DeepSpeed re-points them)
        mine = {id(p) for group in groups for p in group}
        owners = sorted({key for model, key in keys.items() if isinstance(model, nn.Module)
                         and any(id(p) in mine for p in model.parameters())})
        return {"class": _class(obj), "owners": owners,
                "groups": [len(group) for group in groups],
                "lr": [_rate(g) for g in obj.param_groups]}  # not matched: checked at the restore
    optimizer = getattr(obj, "optimizer", None)
    with_key = keys.get(optimizer) if isinstance(optimizer, torch.optim.Optimizer) else None
    return {"class": _class(obj), "optimizer": with_key}


def _rate(group: dict[str, Any]) -> Any:
    rate = group.get("initial_lr", group.get("lr"))  # schedulers move lr, never initial_lr
    return float(rate) if isinstance(rate, (int, float, torch.Tensor)) else None


def _matched(description: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in description.items() if k != "lr"}


def _loose(description: dict[str, Any]) -> Any:
    """A model's description without which parameters are trainable."""
    params = description.get("params")
    return (description["class"], [p[:2] for p in params]) if params is not None else None


def _index(key: str) -> int:
    digits = key[len(key.rstrip("0123456789")):]
    return int(digits) if digits else -1


def summary(description: dict[str, Any]) -> str:
    params = description.get("params")
    if params is not None:
        frozen = sum(1 for p in params if not p[2])
        first = ", ".join(f"{n} {tuple(s)}" for n, s, _ in params[:3])
        return (f"{description['class']} with {len(params)} parameters ({first}"
                f"{', ...' if len(params) > 3 else ''}; {frozen} frozen)")
    if "owners" in description:
        return f"{description['class']} over {', '.join(description['owners']) or 'no model met'}"
    return f"{description['class']} of {description.get('optimizer')}"


class Matcher:
    """The keys a resumable run gives the models, optimizers and schedulers it meets."""

    def __init__(self, keys: weakref.WeakKeyDictionary[Any, str], where: str) -> None:
        self.keys, self.where = keys, where  # where: the scope, for messages
        self.names: set[str] = set()  # the checkpoint's entries
        self.entry = Described()  # saved with the run's objects
        self.saved: dict[str, Any] | None = None  # the checkpoint's (None: match by order)
        self.built: dict[str, Any] = {}  # the learning rates this script builds, by key
        self.read = False

    def start(self, checkpoint: Checkpoint | None) -> None:
        """Read the descriptions of ``checkpoint`` (once; this rank alone: no collective)."""
        if self.read or checkpoint is None:
            return
        self.read = True
        self.names = checkpoint.names if checkpoint is not None else set()
        if ENTRY in self.names:
            from .dcp import read_entry

            self.saved = json.loads(read_entry(checkpoint.folder, ENTRY)["json"])
            self.entry.descriptions.update(self.saved)  # entries not met again keep theirs

    def key(self, obj: Any, kind: str, taken: set[str]) -> str:
        """The key of ``obj``, met now (``taken``: the keys given already)."""
        where, names = self.where, self.names
        mine = describe(obj, kind, self.keys)
        saved = self.saved
        if saved is None:
            key = f"{kind}{sum(1 for k in taken if k.rstrip('0123456789') == kind)}"
        else:
            free = sorted((k for k in saved if k.rstrip("0123456789") == kind and k not in taken),
                          key=_index)
            same = [k for k in free if _matched(saved[k]) == _matched(mine)]
            loose = [k for k in free if kind == "model" and _loose(saved[k]) == _loose(mine)]
            alike = [k for k in free if saved[k].get("class") == mine["class"]]
            if same or loose:
                key = (same or loose)[0]
                if not same:
                    warn_user(f"{where}: {summary(mine)} restores {key!r}, saved as "
                              f"{summary(saved[key])}: other parameters are trainable now.")
            elif alike:
                met = sum(1 for k in taken if k.rstrip("0123456789") == kind)
                raise CheckpointError(
                    f"{where}: the {kind} {'called' if kind == 'model' else 'stepped'} "
                    f"{ordinal(f'{kind}{met}')}, {summary(mine)}, matches none of the "
                    f"checkpoint's; its {alike[0]!r} of that class is {summary(saved[alike[0]])}."
                    " Objects are found again by what they are (parameter names and shapes, "
                    "which are trainable, the models an optimizer steps, ...): if the script "
                    "changed them, give this run its own folder (or move the old checkpoints "
                    "away)."
                )
            else:
                key = next(k for i in range(len(taken) + len(names) + 1)
                           if (k := f"{kind}{i}") not in taken and k not in names)
        self.built[key] = mine.get("lr")
        if saved is not None and "lr" in saved.get(key, {}):
            mine["lr"] = saved[key]["lr"]  # still the run's: its state keeps those rates
        self.entry.descriptions[key] = mine
        return key

    def check_lr(self, key: str, optimizer: torch.optim.Optimizer, warn: bool) -> None:
        """Say so (``warn``: this rank) when the script builds ``optimizer`` with other learning
        rates than the run saved as ``key`` did (just restored: the saved ones are used)."""
        built = (self.saved or {}).get(key, {}).get("lr")
        now = self.built.get(key)
        if not warn or built is None or now is None or built == now:
            return
        rates = [group["lr"] for group in optimizer.param_groups]
        warn_user(f"{self.where}: the optimizer {key!r} ({type(optimizer).__name__}) is built with "
                f"lr={_short(now)} in this script, and the run it resumes was built with "
                f"lr={_short(built)}: the checkpoint's state is used (lr now {_short(rates)}), so "
                "the run resumes as it was. To train on with the new lr, set the param_groups' "
                "lr (and a scheduler's base_lrs) after the restore, which comes at the "
                "optimizer's first step, or start the changed run in a new folder.")


def _short(rates: list[Any]) -> str:
    return str(rates[0]) if len(set(rates)) == 1 else str(rates)
