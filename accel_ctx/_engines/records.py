"""What an engine did to a module, kept beside the module: never on it.

A module's first top-level call in a job adopts it (``adopt``); its record names the job that
owns it and, for a root, its data-parallel engine (DDP, FSDP2). Records sit in a table keyed by
the module's identity, so ``torch.save(model)``, ``pickle``, ``copy.deepcopy``, ``repr`` and
``vars`` of a user's module see plain torch.
"""

from __future__ import annotations

import weakref

from torch import nn

from .._kernel.concern import Engine


class ModuleRecord:
    """What a distributed runtime did to one module (kept beside it, never on it)."""

    __slots__ = ("engine", "owner", "root")

    def __init__(self, owner: object, root: bool) -> None:
        self.owner = owner
        self.root = root
        # the engine of a root (DDP, FSDP2): None until decided at its first call, then the engine,
        # or False when it needs none (nothing to train, or a single process)
        self.engine: Engine | bool | None = None


class _ModuleRecords:
    """Module -> record, beside the modules: nothing of ours in a user's module, so that
    ``torch.save(model)``, ``pickle``, ``copy.deepcopy``, ``repr`` and ``vars`` see plain torch.

    Keyed by identity with weak references (a module class may define ``__eq__``/``__hash__``);
    an entry goes with its module. A record's engine (DDP) refers to its module, so an adopted
    model stays alive while its job holds the record: the job releases them when it ends, and
    ``find_executable_batch_size`` releases the models of a failed attempt.
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[nn.Module], ModuleRecord]] = {}

    def get(self, module: nn.Module) -> ModuleRecord | None:
        entry = self._entries.get(id(module))
        return entry[1] if entry is not None and entry[0]() is module else None

    def set(self, module: nn.Module, record: ModuleRecord) -> None:
        key = id(module)
        entries = self._entries

        def gone(ref: weakref.ref[nn.Module]) -> None:
            entry = entries.get(key)
            if entry is not None and entry[0] is ref:
                del entries[key]

        entries[key] = (weakref.ref(module, gone), record)

    def pop(self, module: nn.Module) -> None:
        entry = self._entries.get(id(module))
        if entry is not None and entry[0]() is module:
            del self._entries[id(module)]


_module_records = _ModuleRecords()


module_record = _module_records.get
"""The record of ``module``, or None (bound once: a forward asks this every step)."""


def set_module_record(module: nn.Module, record: ModuleRecord | None) -> None:
    if record is None:
        _module_records.pop(module)
    else:
        _module_records.set(module, record)
