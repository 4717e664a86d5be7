"""Decisions the ranks take together: ``any_rank``, ``all_ranks``, ``synchronize_rng_states``.

Early stopping, "a rank saw a NaN", "every rank is done" are one small all_reduce of a flag;
written by hand they are the collective users most often get wrong (a rank that skips it hangs
the others). Each call here is a collective of the innermost ``distributed()`` job, with the
same blame and debug checks as ``reduce``; in a single process it is the flag itself.
"""

from __future__ import annotations

import numbers
import random
from collections.abc import Iterable
from typing import Any

import torch

from .._options import checked
from ..errors import ConfigurationError
from .broadcast import broadcast_object
from .collectives import group_job, reduce

_KINDS = ("python", "numpy", "torch", "cuda")


def _flag(value: Any, call: str) -> bool | torch.Tensor:
    """A Python bool, or a one-element int32 tensor (left on its device: no host sync)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ConfigurationError(
                f"{call} takes one flag per rank, got a tensor of shape {tuple(value.shape)}; "
                "reduce it first, e.g. any_rank(torch.isnan(loss).any())."
            )
        return (value.detach().reshape(()) != 0).to(torch.int32)
    if not isinstance(value, numbers.Number) and not callable(getattr(value, "item", None)):
        # a str ('no' is truthy), None or a container: its truth is no flag's
        raise ConfigurationError(
            f"{call} takes a bool, a number or a one-element tensor, got {value!r}; e.g. "
            "any_rank(loss.isnan()), all_ranks(epoch_done).")
    try:
        return bool(value)
    except Exception as exc:  # e.g. an object whose __bool__ raises
        raise ConfigurationError(f"{call} needs a flag that bool() accepts: {exc}") from exc


def _decide(value: Any, op: str, call: str) -> bool:
    flag = _flag(value, call)
    if group_job() is None:
        return bool(flag)
    tensor = flag if isinstance(flag, torch.Tensor) else torch.tensor(int(flag), dtype=torch.int32)
    return bool(reduce(tensor, "max" if op == "any" else "min").item())


@checked
def any_rank(flag: Any) -> bool:
    """True on every rank when ``flag`` is true on at least one rank.

    ``flag`` is a bool, a number, or a one-element tensor (a NaN counts as true, as for
    ``bool()``). Every rank of the job must call it, in the same order as its other
    collectives; every rank gets the same answer, so they can all leave a loop together. In a
    single process it is ``bool(flag)``.

    Examples:
        >>> import torch
        >>> from accel_ctx import any_rank, distributed
        >>> with distributed():
        ...     loss = torch.tensor(float("nan"))
        ...     stop = any_rank(torch.isnan(loss))
        >>> stop
        True
    """
    return _decide(flag, "any", "any_rank()")


@checked
def all_ranks(flag: Any) -> bool:
    """True on every rank when ``flag`` is true on every rank (e.g. "all are done").

    Takes the same flags as :func:`any_rank` and must likewise be called by every rank. In a
    single process it is ``bool(flag)``.

    Examples:
        >>> from accel_ctx import all_ranks, distributed
        >>> with distributed():
        ...     done = all_ranks(True)
        >>> done
        True
    """
    return _decide(flag, "all", "all_ranks()")


@checked
def synchronize_rng_states(
    kinds: Iterable[str] = _KINDS,
    generators: Iterable[torch.Generator] = (),
    *,
    src: int = 0,
) -> None:
    """Give every rank rank ``src``'s random states, so the ranks draw the same numbers next.

    ``kinds`` picks the global generators: ``"python"`` (``random``), ``"numpy"`` (its legacy
    global state, when numpy is installed), ``"torch"`` (the CPU generator) and ``"cuda"``
    (the current CUDA device's, when CUDA is initialised); ``generators`` adds your own
    ``torch.Generator`` objects (each rank passes its own, in the same order). Every rank must
    call it. In a single process nothing changes. accel_ctx already shares rank 0's states
    where its loaders need it (shuffling), so this is for your own random draws: augmentations
    that must agree, a random choice of task, a dropout mask that must match.

    Examples:
        >>> import random
        >>> from accel_ctx import distributed, synchronize_rng_states
        >>> with distributed():
        ...     synchronize_rng_states(["python", "torch"])
        ...     x = random.random()
    """
    if isinstance(kinds, str):  # iterating 'torch' would give its letters
        raise ConfigurationError(
            f"synchronize_rng_states(kinds={kinds!r}): give a list of kinds, e.g. [{kinds!r}].")
    kinds = tuple(kinds)
    unknown = [k for k in kinds if k not in _KINDS]
    if unknown:
        raise ConfigurationError(
            f"synchronize_rng_states(kinds={list(kinds)!r}): unknown {unknown}; choose among "
            f"{list(_KINDS)}."
        )
    generators = list(generators)
    for g in generators:
        if not isinstance(g, torch.Generator):
            raise ConfigurationError(
                "synchronize_rng_states(generators=...) takes torch.Generator objects, got "
                f"{type(g).__name__}."
            )
    job = group_job()
    if job is None:  # with several ranks broadcast_object checks src with all of them
        if isinstance(src, bool) or not isinstance(src, int) or src != 0:
            raise ConfigurationError(
                f"synchronize_rng_states(src={src!r}): a single process has only rank 0: give "
                "src=0.")
        return
    mine = _states(kinds, generators) if job.rank == src else None
    states = broadcast_object(mine, src=src)
    if job.rank != src and states is not None:
        _set_states(states, generators)


def _states(kinds: tuple[str, ...], generators: list[torch.Generator]) -> dict[str, Any]:
    states: dict[str, Any] = {"generators": [g.get_state() for g in generators]}
    if "python" in kinds:
        states["python"] = random.getstate()
    if "numpy" in kinds:
        try:
            import numpy
        except ImportError:
            pass
        else:
            states["numpy"] = numpy.random.get_state()
    if "torch" in kinds:
        states["torch"] = torch.get_rng_state()
    if "cuda" in kinds and torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        states["cuda"] = torch.cuda.get_rng_state().cpu()
    return states


def _set_states(states: dict[str, Any], generators: list[torch.Generator]) -> None:
    theirs = states["generators"]
    if len(theirs) != len(generators):
        raise ConfigurationError(
            f"synchronize_rng_states(): the source rank passed {len(theirs)} generator(s), this "
            f"rank {len(generators)}; pass the same generators, in the same order, on every rank."
        )
    for g, s in zip(generators, theirs, strict=True):
        g.set_state(s)
    if "python" in states:
        random.setstate(states["python"])
    if "numpy" in states:
        import numpy

        numpy.random.set_state(states["numpy"])
    if "torch" in states:
        torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
