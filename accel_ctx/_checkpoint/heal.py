"""What a replica group sends a peer that heals from it, and how the healing group takes it.

A group that comes back (restarted, or started late) receives a live peer's models,
optimizers, LR schedulers, DataLoader positions and random streams at its first quorum, which
it reaches when its first DataLoader is iterated (before the epoch is planned) or at its first
forward. Most of these objects are not met yet then (a model at its first forward, an
optimizer at its first step, a scheduler at its first ``step()``): each state waits and is
loaded when its object is met, matched by meeting order, as the same script meets them in
the same order in every group. Nothing is read from disk: the state is the peer's at the step
the group heals to, so its weights equal its peers' from its first step on.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from .._data import position as _position
from .._data import records as _records
from .._kernel import state as _state
from ..errors import ConfigurationError
from . import rng as _rng
from .resume_run import ResumeRuntime

_KINDS = ("models", "optimizers", "schedulers")


class PeerState:
    """The objects a replica group met, in order, and the states a peer sent for them."""

    def __init__(self) -> None:
        self._met: dict[str, list[weakref.ref[Any]]] = {kind: [] for kind in _KINDS}
        self._pending: dict[str, list[Any]] = {kind: [] for kind in _KINDS}
        self._loaders: list[weakref.ref[DataLoader[Any]]] = []
        self._pending_loaders: list[dict[str, Any]] = []
        self.source = -1  # the group the last state came from
        self._stack: _state.Stack | None = None  # this process's scopes (read while it waits)
        self._held: dict[str, Any] | None = None  # hold(): the step's start, for a peer

    # ---- meeting objects -------------------------------------------------------------------------
    def folder(self) -> str | None:
        """The resumable() folder of this process's scope, resolved (every group must share it)."""
        stack = _state.current()
        resume = stack.find(ResumeRuntime) if stack is not None else None
        return str(resume.folder.resolve()) if resume is not None else None

    def models(self) -> list[nn.Module]:
        """The trainable models met so far, in order."""
        return [m for m in (ref() for ref in self._met["models"]) if m is not None]

    def loaders(self) -> list[DataLoader[Any]]:
        """The DataLoaders met so far, in order."""
        return [x for x in (ref() for ref in self._loaders) if x is not None]

    def met(self, kind: str, obj: Any) -> None:
        """``obj`` (a model, an optimizer, a scheduler) is met: a state waiting for it loads."""
        self._stack = _state.current() or self._stack
        refs = self._met[kind]
        if any(ref() is obj for ref in refs):
            return
        refs.append(weakref.ref(obj))
        if self._pending[kind]:
            _load_one(kind, obj, self._pending[kind].pop(0), self.source)

    def met_loader(self, loader: Any, record: Any) -> None:
        """A DataLoader's first iteration: a position waiting for a loader like it applies."""
        self._stack = _state.current() or self._stack
        if not isinstance(loader, DataLoader):
            return
        self._loaders.append(weakref.ref(loader))
        self._apply_position(loader, record)

    def _apply_position(self, loader: DataLoader[Any], record: Any) -> None:
        """The waiting position of a loader like ``loader`` (if one is), for its next epoch."""
        index = _position.pick([e["position"] for e in self._pending_loaders], loader)
        if index is not None:
            entry = self._pending_loaders.pop(index)
            _position.apply_position(loader, record, entry["position"], entry["generator"])

    # ---- a peer's side ---------------------------------------------------------------------------
    def hold(self, now: bool) -> None:
        """``now``: what :meth:`state` sends besides the tensors is what stands at this moment
        (a step's start, on the main thread: its quorum forms while the step runs, and torchft
        reads the state in its own thread); else what stands when it is read."""
        self._held = self._volatile() if now else None

    def _volatile(self) -> dict[str, Any]:
        """What a step changes besides the tensors a commit changes: the random streams, the
        step counts, the concerns' counters, the DataLoader positions."""
        sent: dict[str, Any] = {"rng": _rng.capture()}
        stack = self._stack
        # the session's step count and each open concern's state (accumulation counters, the
        # fp16 loss scale, local_sgd()'s periods and DiLoCo's outer state), as a checkpoint has
        sent["step"] = stack.session.step if stack is not None else 0
        if stack is not None:  # fp16's skipped steps: the device's flags, read (state() too)
            stack.session.read_skips()
        sent["skipped"] = stack.session.skipped_steps if stack is not None else 0
        sent["concerns"] = ({c.slot: st for c in stack.concerns if (st := c.state_dict())}
                            if stack is not None else {})
        loaders = []
        for loader in (ref() for ref in self._loaders):
            if loader is None:
                continue
            loaders.append({  # every rank of every group stands where this one does
                "position": _position.position(loader, None, [_position.yielded(loader)]),
                "generator": _position.generator_state(loader)})
        sent["loaders"] = loaders + self._pending_loaders
        return sent

    def state(self, group: int) -> dict[str, Any]:
        """What this group sends a healing peer (no collective: the ranks of every group stand
        at the same batch)."""
        sent: dict[str, Any] = {"group": group, **(self._held or self._volatile())}
        for kind in _KINDS:
            objs = [o for o in (ref() for ref in self._met[kind]) if o is not None]
            # sharded(): each rank sends its own shards (the same rank of the healing group
            # receives them), as plain tensors; unchanged until the step's commit, which waits
            # for the peer to have them
            sent[kind] = [_locals(o.state_dict()) for o in objs] + self._pending[kind]
        return sent

    # ---- the healing side ------------------------------------------------------------------------
    def load(self, sent: dict[str, Any]) -> None:
        """Take a peer's state: what is met loads now, the rest when it is met."""
        self.source = int(sent["group"])
        stack = _state.current()
        resume = stack.find(ResumeRuntime) if stack is not None else None
        if resume is not None:  # the peer's state is newer than any checkpoint on disk
            resume.superseded()
        _rng.restore(sent["rng"])
        if stack is not None:
            stack.session.step = int(sent["step"])  # run.step and state().step go on from there
            stack.session.forget_unread()  # the peer's count replaces this group's
            stack.session.skipped_steps = int(sent.get("skipped", 0))
            for concern in stack.concerns:
                if concern.slot in sent["concerns"]:
                    concern.load_state_dict(sent["concerns"][concern.slot])
        for kind in _KINDS:
            objs = [o for o in (ref() for ref in self._met[kind]) if o is not None]
            states = list(sent[kind])
            for obj, state in zip(objs, states, strict=False):
                _load_one(kind, obj, state, self.source)
            self._pending[kind] = states[len(objs):]
        self._pending_loaders = list(sent["loaders"])
        for loader in (ref() for ref in self._loaders):
            record = _records.peek_loader_record(loader) if loader is not None else None
            if loader is not None and record is not None:  # iterated already: its next epoch
                self._apply_position(loader, record)


def _locals(state: Any) -> Any:
    """``state`` with every DTensor replaced by its local shard."""
    if isinstance(state, dict):
        return {k: _locals(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_locals(v) for v in state)
    to_local = getattr(state, "to_local", None)
    return to_local().detach() if to_local is not None else state


def _load_model(model: nn.Module, state: dict[str, Any]) -> None:
    """Copy a peer's tensors into the model's own (a sharded one's local shards), in place."""
    own = model.state_dict()
    if own.keys() != state.keys():
        missing, extra = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
        raise RuntimeError(f"missing {missing[:3]}, unexpected {extra[:3]}")
    with torch.no_grad():
        for name, target in own.items():
            local = target.to_local() if hasattr(target, "to_local") else target
            if tuple(local.shape) != tuple(state[name].shape):
                raise RuntimeError(f"{name}: {tuple(state[name].shape)} for "
                                   f"{tuple(local.shape)}")
            local.copy_(state[name])


def _load_optimizer(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """A peer's optimizer state, its shards made DTensors like this rank's parameters."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    per_param = dict(state["state"])
    for index, values in per_param.items():
        param = params[int(index)] if int(index) < len(params) else None
        mesh = getattr(param, "device_mesh", None)
        if param is None or mesh is None:
            continue
        from torch.distributed.tensor import DTensor  # only a sharded model gets here

        local_shape = param.to_local().shape
        per_param[index] = {
            k: DTensor.from_local(v, mesh, param.placements,
                                  run_check=False, shape=param.shape, stride=param.stride())
            if isinstance(v, torch.Tensor) and v.shape == local_shape and v.dim() > 0 else v
            for k, v in values.items()}
    optimizer.load_state_dict({**state, "state": per_param})


def _load_one(kind: str, obj: Any, state: Any, source: int) -> None:
    try:
        if kind == "models":
            _load_model(obj, state)
        elif kind == "optimizers":
            _load_optimizer(obj, state)
        else:
            obj.load_state_dict(state)
    except (RuntimeError, KeyError, ValueError) as exc:
        raise ConfigurationError(
            f"healing from replica group {source}: its {kind[:-1]} does not fit this group's "
            f"{type(obj).__name__} ({str(exc).splitlines()[0][:200]}). Every replica group must "
            "run the same script with the same model and optimizer.") from exc

