"""Exceptions raised by accel_ctx.

Every error names what went wrong and how to fix it. Argument errors also derive from the
built-in ``ValueError`` or ``TypeError``, so existing ``except`` clauses keep working.

Examples:
    >>> from accel_ctx import errors, mixed_precision
    >>> try:
    ...     mixed_precision("fp4")
    ... except errors.ConfigurationError as e:
    ...     print(type(e).__name__)
    ConfigurationError
"""

from __future__ import annotations

__all__ = [
    "AccelCtxError",
    "ArgumentError",
    "CheckpointError",
    "ConfigurationError",
    "DistributedError",
    "LaunchEnvironmentError",
    "MisnestedScopeError",
    "NotInitializedError",
    "PatchConflictError",
    "RendezvousError",
    "UnsupportedTorchError",
]


class AccelCtxError(Exception):
    """Base class of every error accel_ctx raises on purpose.

    Examples:
        >>> from accel_ctx.errors import AccelCtxError
        >>> issubclass(AccelCtxError, Exception)
        True
    """


class ConfigurationError(AccelCtxError, ValueError):
    """An argument or option has a value accel_ctx cannot use (unknown policy, k < 1, ...).

    Examples:
        >>> from accel_ctx import accumulate
        >>> from accel_ctx.errors import ConfigurationError
        >>> try:
        ...     accumulate(0)
        ... except ConfigurationError:
        ...     pass
    """


class ArgumentError(ConfigurationError, TypeError):
    """A call does not fit the function: a misspelt keyword ("did you mean"), a missing or an
    extra argument. Also a ``TypeError``, the error Python itself raises for such a call.

    Examples:
        >>> from accel_ctx import mixed_precision
        >>> from accel_ctx.errors import ArgumentError
        >>> try:
        ...     mixed_precision("bf16", init_scal=2.0)
        ... except TypeError as e:
        ...     print(type(e).__name__, "|", str(e).split("?")[0])
        ArgumentError | mixed_precision() got an unknown option 'init_scal'. Did you mean 'init_scale'
    """


class MisnestedScopeError(AccelCtxError, RuntimeError):
    """Scopes were exited in a different order than they were entered, or in another thread.

    Examples:
        >>> from accel_ctx.errors import MisnestedScopeError
        >>> issubclass(MisnestedScopeError, RuntimeError)
        True
    """


class PatchConflictError(AccelCtxError, RuntimeError):
    """Another library replaced a PyTorch attribute that accel_ctx patched while a scope was open.

    Examples:
        >>> from accel_ctx.errors import PatchConflictError
        >>> issubclass(PatchConflictError, RuntimeError)
        True
    """


class NotInitializedError(AccelCtxError, RuntimeError):
    """An operation needs an open scope (for example ``distributed()``) and none is active.

    Examples:
        >>> from accel_ctx.errors import NotInitializedError
        >>> issubclass(NotInitializedError, RuntimeError)
        True
    """


class LaunchEnvironmentError(AccelCtxError, ValueError):
    """The launch environment variables (RANK, WORLD_SIZE, SLURM_*, ...) contradict each other.

    Examples:
        >>> from accel_ctx.errors import LaunchEnvironmentError
        >>> issubclass(LaunchEnvironmentError, ValueError)
        True
    """


class DistributedError(AccelCtxError, RuntimeError):
    """A collective or a peer failed; the message names the rank that saw it.

    Examples:
        >>> from accel_ctx.errors import DistributedError
        >>> issubclass(DistributedError, RuntimeError)
        True
    """


class RendezvousError(DistributedError):
    """The processes of a job could not find each other within the timeout.

    Examples:
        >>> from accel_ctx.errors import RendezvousError
        >>> issubclass(RendezvousError, TimeoutError) or issubclass(RendezvousError, RuntimeError)
        True
    """


class CheckpointError(AccelCtxError, RuntimeError):
    """A checkpoint cannot be used: corrupt or truncated file, or saved from other objects.

    The message names the file or the keys that differ, and what to do.

    Examples:
        >>> from accel_ctx.errors import CheckpointError
        >>> issubclass(CheckpointError, RuntimeError)
        True
    """


class UnsupportedTorchError(AccelCtxError, ImportError):
    """The installed torch is older than accel_ctx supports, or lacks a feature a call asks for.

    The message names the torch release that has it. Also an ``ImportError``: ``import
    accel_ctx`` raises it on a torch below the supported floor.

    Examples:
        >>> from accel_ctx.errors import UnsupportedTorchError
        >>> issubclass(UnsupportedTorchError, ImportError)
        True
    """
