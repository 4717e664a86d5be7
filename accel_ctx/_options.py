"""Options checked where they are given, with one rule and one message for every public name.

A misspelt keyword raises :class:`~accel_ctx.errors.ConfigurationError` naming the function
and the closest valid option ("did you mean"); a value of the wrong type or out of range raises
it naming the option, the value and what to give. Nothing is taken on trust: a string where a
flag is expected (``'no'`` is truthy) is refused, not read as ``True``. A leaf module (no torch:
the launcher's ``launch()`` uses it too).

Examples:
    >>> from accel_ctx._options import checked
    >>> @checked
    ... def train(steps, *, lr=0.1):
    ...     return steps * lr
    >>> train(10, lrr=0.5)
    Traceback (most recent call last):
    ...
    accel_ctx.errors.ArgumentError: train() got an unknown option 'lrr'. Did you mean 'lr'? ...
"""

from __future__ import annotations

import functools
import math
import numbers
import os
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from .errors import ArgumentError, ConfigurationError

F = TypeVar("F", bound=Callable[..., Any])


def unknown_option(call: str, name: str, valid: Iterable[str]) -> ArgumentError:
    """The error for an option ``call()`` does not take: the closest valid one and the list."""
    names = list(dict.fromkeys(valid))
    close = close_option(name, names)
    hint = f" Did you mean {close!r}?" if close else ""
    listed = f"Valid options: {', '.join(names)}." if names else f"{call}() takes no options."
    return ArgumentError(f"{call}() got an unknown option {name!r}.{hint} {listed}")


def close_option(name: str, valid: Iterable[str]) -> str | None:
    """The valid option ``name`` is a likely misspelling of, or None."""
    import difflib  # on a mistake only: importing accel_ctx stays cheap

    close = difflib.get_close_matches(name, list(valid), n=1)
    return close[0] if close else None


def checked(obj: F) -> F:
    """Turn Python's bare ``TypeError`` for a call that does not fit the signature (an unknown
    keyword, too many or missing arguments) into an ArgumentError (a ConfigurationError and a
    TypeError, so ``except`` clauses for either keep working) that names the function
    and, for a misspelt keyword, the option meant. On a class, its ``__init__`` is checked.

    Only errors raised while binding the arguments are translated (the callee never started);
    a ``TypeError`` raised inside the function passes through untouched. A call that fits costs
    one extra Python call.
    """
    if isinstance(obj, type):
        init = obj.__init__  # type: ignore[misc]  # its own, or the one it inherits
        setattr(obj, "__init__", _checking(init, obj.__name__, method=True))  # noqa: B010
        return obj
    return _checking(obj, obj.__name__, method=False)  # type: ignore[return-value]


def _checking(fn: Callable[..., Any], call: str, method: bool) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except TypeError as exc:
            tb = exc.__traceback__
            if tb is None or tb.tb_next is not None:
                raise  # raised inside the function, not by the call itself
            raise _misfit(fn, call, args[1:] if method else args, kwargs, method) from None

    return run


def _misfit(fn: Callable[..., Any], call: str, args: tuple[Any, ...], kwargs: dict[str, Any],
            method: bool) -> ArgumentError:
    import inspect

    params = list(inspect.signature(fn).parameters.values())[1 if method else 0:]
    signature = inspect.Signature([p.replace(annotation=inspect.Parameter.empty) for p in params])
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        named = [p.name for p in params
                 if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                               inspect.Parameter.KEYWORD_ONLY)]
        unknown = [k for k in kwargs if k not in named]
        if unknown:
            return unknown_option(call, unknown[0], named)
    try:
        signature.bind(*args, **kwargs)
        reason = "its arguments do not fit"
    except TypeError as why:
        reason = str(why)
    return ArgumentError(f"{call}(): {reason}. Call it as {call}{signature}.")


# ---- values --------------------------------------------------------------------------------
def flag(call: str, name: str, value: object) -> bool:
    """``value`` if it is a bool; anything else (``'no'``, ``1``, None) is refused."""
    if not isinstance(value, bool):
        taken = " (a string like 'no' would count as True)" if isinstance(value, str) else ""
        raise ConfigurationError(f"{call}({name}={value!r}): give True or False{taken}.")
    return value


def whole(call: str, name: str, value: object, minimum: int = 0, fix: str = "") -> int:
    """``value`` as an int if it is a whole number >= ``minimum`` (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ConfigurationError(
            f"{call}({name}={value!r}): {fix or f'give a whole number >= {minimum}.'}")
    return int(value)


def positive(call: str, name: str, value: object, fix: str = "", zero: bool = False) -> float:
    """``value`` as a float if it is a finite number > 0 (``zero``: >= 0); bools and strings
    refused."""
    number = float(value) if isinstance(value, numbers.Real) and not isinstance(
        value, bool) else math.nan
    if not math.isfinite(number) or number < 0 or (number == 0 and not zero):
        raise ConfigurationError(
            f"{call}({name}={value!r}): {fix or 'give a positive, finite number.'}")
    return number


def positive_seconds(value: object) -> float | None:
    """``value`` (a number, or a string of one: a flag's, an environment variable's) as a
    positive, finite number of seconds; None for anything else (a bool is no number).

    >>> [positive_seconds(v) for v in ("2.5", 60, 0, "inf", "soon", True)]
    [2.5, 60.0, None, None, None, None]
    """
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds > 0 else None


def file_path(call: str, name: str, value: object) -> str | os.PathLike[str]:
    """``value`` if it names a file or folder (a str or a path object)."""
    if isinstance(value, (str, os.PathLike)) and os.fspath(value):
        return value
    raise ConfigurationError(
        f"{call}({name}={value!r}): give a path, as a str or a pathlib.Path.")


def text(call: str, name: str, value: object) -> str | None:
    """``value`` if it is a str or None."""
    if value is not None and not isinstance(value, str):
        raise ConfigurationError(f"{call}({name}={value!r}): give a str, or None.")
    return value
