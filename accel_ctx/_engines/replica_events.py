"""What a replica group says: one line per event, and the error of a quorum that failed."""

from __future__ import annotations

import socket
from datetime import timedelta
from urllib.parse import urlsplit

from .._job.env import replica_timeout
from ..errors import RendezvousError

FINISHED = "it finished"  # why a step was dropped: a group's loop ended (said as such)


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
            "--min-replicas. If nothing else should be missing, what answers at that address "
            "may not be a torchft lighthouse (another server on that port): check "
            "--lighthouse against the address `accel-ctx lighthouse` printed.")
    return RendezvousError(
        f"replica group {group} cannot reach the lighthouse at {address} "
        f"({f'no answer within {_seconds()} s' if timed_out else text}): start "
        "`accel-ctx lighthouse` there, or give the launcher the address it prints "
        "(--lighthouse HOST:PORT).")


def changes(group: int, previous: frozenset[int], members: frozenset[int], step: int,
            failure: str | None, left_at: dict[int, int], finished: set[int],
            per_step: int | None) -> list[str]:
    """The lines of a quorum whose members changed, said by the lowest group that stayed
    (none for the others); ``left_at`` (the step each absent group left at) and ``finished``
    (the groups that said they finished: they did not fail) are updated in place."""
    left, joined = sorted(previous - members), sorted(members - previous)
    if group != min(members & previous, default=group):
        left = joined = []
    lines = []
    for each in left:
        left_at.setdefault(each, step)
    failed = [g for g in left if g not in finished]
    if failed:
        lines.append(_left(failed, step, failure or "it stopped answering the lighthouse",
                           len(members)))
    if joined:
        away = [step - left_at.pop(g) for g in joined if g in left_at]
        lines.append(_joined(joined, step, len(members), max(away, default=0), per_step))
    finished -= set(left)
    return lines


def missing(groups: list[int], members: int, address: str) -> str:
    """Groups that did not arrive for the job's first quorum."""
    return (f"replica group{'s' * (len(groups) > 1)} {_listed(groups)} did not reach the "
            f"lighthouse at {address} within {_seconds()} s; {_go_on(members)} without "
            f"{'them; each' if len(groups) > 1 else 'it; it'} joins at the current step when "
            "it arrives.")


def _left(groups: list[int], step: int, why: str, members: int) -> str:
    """Groups that left the quorum at ``step``, and why (said of one: "it ...")."""
    if len(groups) > 1 and why.startswith("it "):
        why = "they " + why[3:]
    return (f"replica group{'s' * (len(groups) > 1)} {_listed(groups)} left at step {step} "
            f"({why}); {_go_on(members)}.")


def _joined(groups: list[int], step: int, members: int, away: int = 0,
           per_step: int | None = None) -> str:
    """Groups back in the quorum at ``step``; ``away``: the steps taken without them (their
    share of each was not trained), ``per_step``: the samples one group trains in a step."""
    text = (f"replica group{'s' * (len(groups) > 1)} {_listed(groups)} joined at step {step}; "
            f"{_groups(members, 'trains', 'train')}.")
    if away > 0:
        whose = "their shares" if len(groups) > 1 else "its share"
        samples = f" ({away * per_step * len(groups)} samples)" if per_step else ""
        text += (f" {whose.capitalize()} of the {away} step{'s' * (away > 1)} taken without "
                 f"{'them' if len(groups) > 1 else 'it'} {'were' if len(groups) > 1 else 'was'} "
                 f"not trained{samples}.")
    return text


def finished(groups: list[int], step: int, members: int) -> str:
    """Groups whose loop ended at ``step`` while the others go on (not a failure)."""
    return (f"replica group{'s' * (len(groups) > 1)} {_listed(groups)} finished at step "
            f"{step}; {_go_on(members)} (the step under way is taken again, with "
            f"the next batch, without {'them' if len(groups) > 1 else 'it'}).")


def sizes(group: int, size: int, like: int, reference: int) -> str:
    """The error of a group whose number of processes is not the others'."""
    return (f"replica group {group} has {size} process{'es' * (size != 1)} and replica group "
            f"{like} has {reference}: the groups average each rank's gradients with the same "
            "rank of the others, so every group needs as many. Start every group's launcher "
            "with the same -n (and --nnodes).")


def refused(why: str) -> str:
    """What the groups that stay say of one refused at their quorum (``why``: its error's
    first clause)."""
    return f"{why}: it is refused and stops; this job trains on without it."


def clash(group: int, address: str) -> str:
    """The error of a group that found another member with its index at the lighthouse."""
    return (f"replica group {group} found another replica group {group} at the lighthouse at "
            f"{address}: two jobs share that lighthouse, or two groups of one job were started "
            "with the same --replica-group. Give each job its own lighthouse (`accel-ctx "
            "lighthouse` per job, or `accel-ctx launch --replica-groups R`, which starts one), "
            "and each group of a job its own --replica-group, 0 to R-1.")


def clashed(group: int, step: int) -> str:
    """What the group that was there first says of a newcomer with its index."""
    return (f"another replica group {group} (another job at this lighthouse, or a group started "
            f"with the same --replica-group) asked to join at step {step}: it is refused and "
            "stops; this job trains on without it.")


def dropped(group: int, step: int, now: int, members: int) -> str:
    """A group that finds the job went on without it: it did not ask the lighthouse for a
    quorum in time (stopped, paused, swapped out, or slower than the others by seconds)."""
    rest = (f"it rejoins at step {now}, {_groups(members, 'trains', 'train')}"
            if members > 1 else "no other group is left: it trains on alone from its own state")
    return (f"replica group {group} was left out of the job after step {step}: it did not ask "
            "the lighthouse for a quorum within its heartbeat timeout (it was stopped, paused or "
            f"slowed down) and the others went on without it; {rest}.")


def lapsed(group: int) -> str:
    """A group left out while its own step ran (its quorum formed beside the step): it restarts
    and heals like a group that died, before its first batch."""
    return (f"replica group {group} was left out of the job while its step ran (its heartbeat to "
            "the lighthouse lapsed: the machine was overloaded or paused); its step cannot be "
            "mixed with the others', so it stops here, and its launcher restarts it to heal from "
            "a peer (--max-restarts).")


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
