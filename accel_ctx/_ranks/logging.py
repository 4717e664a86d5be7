"""Output once per job: main_print, and get_logger (standard logging; per rank on request).

get_logger also takes what ``accelerate.logging.get_logger`` takes (``log_level=``, and
``main_process_only=`` / ``in_order=`` on each call), so a script moved from Accelerate keeps
its logging lines.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any, Protocol

from typing_extensions import override

from .._kernel import state as _state
from .._options import checked, flag, text
from ..errors import ConfigurationError
from .sync import wait_for_everyone

if TYPE_CHECKING:
    _Adapter = logging.LoggerAdapter[logging.Logger]
else:
    _Adapter = logging.LoggerAdapter


class _RankLogger(_Adapter):
    """A LoggerAdapter deciding per call, from the scope, whether this rank logs."""

    def __init__(self, logger: logging.Logger, all_ranks: bool) -> None:
        super().__init__(logger, {})
        self.all_ranks = all_ranks

    @override
    def isEnabledFor(self, level: int) -> bool:
        if not self.all_ranks and _state.coordinates().rank != 0:
            return False
        return self.logger.isEnabledFor(level)

    @override
    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        # Accelerate's per-call options (the level methods pass them here): main_process_only=
        # False logs this call on every rank; in_order=True with it logs rank by rank, every
        # rank waiting for the others.
        main_only = kwargs.pop("main_process_only", None)
        in_order = kwargs.pop("in_order", False)
        flag("log", "in_order", in_order)
        kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 1  # the record names the caller
        if main_only is None:
            super().log(level, msg, *args, **kwargs)
            return
        flag("log", "main_process_only", main_only)
        every = _RankLogger(self.logger, not main_only)
        if not (in_order and not main_only):
            super(_RankLogger, every).log(level, msg, *args, **kwargs)
            return
        where = _state.coordinates()
        for turn in range(where.world_size):
            if turn == where.rank:
                super(_RankLogger, every).log(level, msg, *args, **kwargs)
            wait_for_everyone()

    @functools.lru_cache(None)  # noqa: B019  # Accelerate's: once per (logger, message, args)
    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        """``warning()`` the first time these arguments are given, then nothing (Accelerate's)."""
        kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 1  # this frame
        self.warning(*args, **kwargs)

    @override
    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        where = _state.coordinates()
        rank, world = where.rank, where.world_size
        kwargs["extra"] = {"rank": rank, "world_size": world, **(kwargs.get("extra") or {})}
        if self.all_ranks and world > 1:
            msg = f"[rank {rank}/{world}] {msg}"
        return msg, kwargs


@checked
def get_logger(
    name: str | None = None, log_level: int | str | None = None, *, all_ranks: bool = False,
    level: int | str | None = None, main_process_only: bool | None = None,
) -> logging.LoggerAdapter[logging.Logger]:
    """A standard logger (``logging.getLogger(name)`` underneath) that logs on rank 0 only.

    The rank is read at each call, so one module-level logger serves inside and outside
    ``distributed()``. ``all_ranks=True``: every rank logs, each message prefixed with
    ``[rank r/W]`` when there are several. Every record carries ``rank`` and ``world_size``
    attributes for formatters (``%(rank)s``). Handlers and levels are the standard ones:
    configure ``logging`` as usual; ``level`` sets the underlying logger's level.

    Accelerate's forms work as they do there: ``get_logger(__name__, log_level="INFO")`` (the
    same as ``level=``), and on each call ``log.info(msg, main_process_only=False)`` (every rank
    logs this one) and ``in_order=True`` with it (rank by rank; every rank must make the call),
    and ``log.warning_once(msg)``. ``get_logger(name, main_process_only=False)`` is
    ``all_ranks=True``.

    Examples:
        >>> import logging, sys
        >>> from accel_ctx import get_logger
        >>> handler = logging.StreamHandler(sys.stdout)
        >>> handler.setFormatter(logging.Formatter("%(rank)s %(message)s"))
        >>> logging.getLogger("train").addHandler(handler)
        >>> log = get_logger("train", level="INFO")
        >>> log.info("epoch %d", 1)
        0 epoch 1
        >>> logging.getLogger("train").removeHandler(handler)
    """
    text("get_logger", "name", name)
    flag("get_logger", "all_ranks", all_ranks)
    if main_process_only is not None:
        flag("get_logger", "main_process_only", main_process_only)
        if all_ranks and main_process_only:
            raise ConfigurationError(
                "get_logger(all_ranks=True, main_process_only=True) asks for both: give one "
                "(main_process_only=False is all_ranks=True).")
        all_ranks = not main_process_only
    if log_level is not None and level is not None and log_level != level:
        raise ConfigurationError(
            f"get_logger(log_level={log_level!r}, level={level!r}): the same option twice "
            "(log_level is Accelerate's name for level): give one.")
    option = "level" if level is not None else "log_level"
    level = level if level is not None else log_level
    if isinstance(level, str):
        level = level.upper()  # Accelerate's log_level="info"
    if level is not None and not _known_level(level):
        raise ConfigurationError(
            f"get_logger({option}={level!r}): give a logging level: a number such as "
            "logging.INFO or a name: 'DEBUG', 'INFO', 'WARNING', 'ERROR', 'CRITICAL'; or None.")
    logger = logging.getLogger(name)
    if level is not None:
        logger.setLevel(level)
    return _RankLogger(logger, all_ranks)


def _known_level(level: object) -> bool:
    if isinstance(level, str):
        return isinstance(logging.getLevelName(level), int)  # a name logging knows
    return isinstance(level, int) and not isinstance(level, bool) and level >= 0


class _Writable(Protocol):
    def write(self, text: str, /) -> Any: ...
    def flush(self) -> Any: ...


@checked
def main_print(
    *values: object, sep: str | None = " ", end: str | None = "\n",
    file: _Writable | None = None, flush: bool = False,
) -> None:
    """``print()`` on the main process (rank 0 of the job) only; the other ranks print nothing.

    Same arguments as the built-in ``print``, which it calls; it does not synchronise the ranks.
    Named ``main_print`` rather than ``print`` so that ``from accel_ctx import *`` never
    shadows the built-in. For leveled, per-rank output use :func:`get_logger`.

    Examples:
        >>> from accel_ctx import main_print
        >>> main_print("epoch", 1, "done")
        epoch 1 done
    """
    text("main_print", "sep", sep)  # checked on every rank, as print() would on rank 0
    text("main_print", "end", end)
    flag("main_print", "flush", flush)
    if _state.coordinates().rank == 0:
        # one write: print() writes each value, separator and end on its own, and on an
        # unbuffered stream shared by several groups' launchers their lines spliced mid-line
        line = (" " if sep is None else sep).join(map(str, values)) + ("\n" if end is None else end)
        print(line, end="", file=file, flush=flush)
