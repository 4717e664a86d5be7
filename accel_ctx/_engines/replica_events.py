"""What a replica group says: one line per event, and the error of a quorum that failed."""

from __future__ import annotations

import socket
from datetime import timedelta
from urllib.parse import urlsplit

from .._job.env import replica_timeout
from ..errors import RendezvousError


def timeout() -> timedelta:
    """How long a quorum, a cross-group collective or a state transfer may take
    (``ACCEL_CTX_REPLICA_TIMEOUT``, 30 s)."""
    return timedelta(seconds=replica_timeout())


def _seconds() -> str:
    return f"{replica_timeout():g}"


def unreachable(group: int, groups: int, address: str, exc: BaseException) -> RendezvousError:
    """The error of a group whose quorum failed: the lighthouse gone, or no quorum there."""
    # torchft raises the same timeout whether the lighthouse is gone or no quorum formed
    # there (fewer groups than its --min-replicas): a connection tells them apart
    text = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
    timed_out = isinstance(exc, TimeoutError) or "Timeout expired" in text
    if timed_out and _answers(address):
        return RendezvousError(
            f"replica group {group} reached the lighthouse at {address}, but no "
            f"quorum formed there within {_seconds()} s: the lighthouse waits until its "
            "--min-replicas groups ask for one, and fewer did. Start the missing groups "
            f"(this job has {groups}), or run `accel-ctx lighthouse` with a smaller "
            "--min-replicas.")
    return RendezvousError(
        f"replica group {group} cannot reach the lighthouse at {address} "
        f"({f'no answer within {_seconds()} s' if timed_out else text}): start "
        "`accel-ctx lighthouse` there, or give the launcher the address it prints "
        "(--lighthouse HOST:PORT).")


def missing(groups: list[int], members: int, address: str) -> str:
    """Groups that did not arrive for the job's first quorum."""
    return (f"replica group{'s' * (len(groups) > 1)} {_listed(groups)} did not reach the "
            f"lighthouse at {address} within {_seconds()} s; {_go_on(members)} without "
            f"{'them; each' if len(groups) > 1 else 'it; it'} joins at the current step when "
            "it arrives.")


def left(groups: list[int], step: int, why: str, members: int) -> str:
    return (f"replica group{'s' * (len(groups) > 1)} {_listed(groups)} left at step {step} "
            f"({why}); {_go_on(members)}.")


def joined(groups: list[int], step: int, members: int) -> str:
    return (f"replica group{'s' * (len(groups) > 1)} {_listed(groups)} joined at step {step}; "
            f"{_groups(members, 'trains', 'train')}.")


def healed(group: int, source: int, step: int, seconds: float) -> str:
    return (f"replica group {group} healed from replica group {source} at step {step} in "
            f"{seconds:.1f} s (models, optimizers, schedulers, DataLoader positions, random "
            "states); it trains from there.")


def _answers(address: str) -> bool:
    """Whether something listens at the lighthouse's ``http://HOST:PORT``."""
    url = urlsplit(address)
    try:
        with socket.create_connection((url.hostname or "", url.port or 0), timeout=5):
            return True
    except (OSError, ValueError):
        return False


def _listed(groups: list[int]) -> str:
    return ", ".join(str(g) for g in groups)


def _go_on(count: int) -> str:
    return f"{_groups(count, 'goes', 'go')} on"


def _groups(count: int, one: str, more: str) -> str:
    return f"{count} group {one}" if count == 1 else f"{count} groups {more}"
