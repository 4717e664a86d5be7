"""The launcher's settings, in one table: adding a setting is one entry in :data:`SETTINGS`.

Each :class:`Setting` feeds every place that names it: the config-file keys and their check
(:mod:`.config`), the flags and questions of ``accel-ctx config`` (:mod:`.config_cmd`), the
flags of ``accel-ctx launch`` (:mod:`.args`) and its ``--help`` (:mod:`.help`). How a setting
acts (what ``nproc`` becomes for torchrun, say) stays with the code that acts on it.

Examples:
    >>> from accel_ctx._launch.settings import SETTINGS, check, setting
    >>> check("nnodes", "2:4", "--nnodes"), check("mixed_precision", " OFF", "--mixed-precision")
    ('2:4', 'no')
    >>> setting("node_rank").flag, [s.key for s in SETTINGS][:2]
    ('--node-rank', ['nproc', 'nnodes'])
"""

from __future__ import annotations

import difflib
import ipaddress
import re
from collections.abc import Callable
from dataclasses import dataclass

from .._job import env as _env
from .._options import positive_seconds
from .._precision.names import POLICIES, canonical
from ..errors import ConfigurationError
from .nproc import MAX_NPROC_VAR

Value = int | str
"""A setting's value in canonical form: what config files hold and ``plan()`` reads."""
CONFIG_FLAG = "--config"
"""``accel-ctx launch --config FILE`` reads FILE alone: it chooses the file, it is no setting."""

_IN_ORDER = ("no", *(p for p in POLICIES if p != "no"))  # fp32 first: the default
_LISTED = f"{', '.join(_IN_ORDER[:-1])} or {_IN_ORDER[-1]}"  # no, bf16, fp16 or fp8
_QUOTED = f"{', '.join(map(repr, _IN_ORDER[:-1]))} or {_IN_ORDER[-1]!r}"  # 'no', 'bf16', 'fp16', 'fp8', 'bf16-true' or 'fp16-true'


@dataclass(frozen=True)
class Setting:
    """One launcher setting: its names, its words for the user, and its check.

    Examples:
        >>> from accel_ctx._launch.settings import setting
        >>> s = setting("max_restarts")
        >>> s.flags, s.convert("2"), s.convert("-1")
        (('--max-restarts',), 2, None)
    """

    key: str
    """Its name in config files and in ``LaunchPlan.settings``."""
    flags: tuple[str, ...]
    """Its flags on ``accel-ctx launch`` and ``accel-ctx config``; launch also takes ``_``."""
    metavar: str
    """The value's name after the flag in help texts."""
    meaning: str
    """One line: in errors, in ``accel-ctx config --help`` and for an unanswered question."""
    help: str
    """Its paragraph in ``accel-ctx launch --help``, wrapped there (a no-break space, \\xa0,
    keeps two words on one line)."""
    question: str
    """What ``accel-ctx config`` asks for it."""
    convert: Callable[[object], Value | None]
    """The canonical form of a (stripped) value as written; None when it is not valid."""
    fix: str
    """What to give instead, said after a value ``convert`` refuses."""
    default: Value | None = None
    """The answer ``accel-ctx config`` offers (None: the question must be answered)."""
    example: str = "X"
    """A value for the error "--flag needs a value, e.g. `--flag EXAMPLE`"."""
    choices: str = ""
    """The usage line's value (default: ``metavar``), e.g. ``N|auto``."""
    several_nodes_only: bool = False
    """``accel-ctx config`` asks for it only when the job has several machines."""
    asked: bool = True
    """``accel-ctx config`` asks for it (False: a flag sets it, the file keeps it)."""

    @property
    def flag(self) -> str:
        """The long flag, which errors name: ``--node-rank``."""
        return next(f for f in self.flags if f.startswith("--"))


def _whole(value: object) -> int | None:
    """An int, or a string of digits; never a bool (TOML ``true`` is no count)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and re.fullmatch(r"\d+", value):
        return int(value)
    return None


def _processes(value: object) -> Value | None:
    if value == "auto":
        return "auto"
    number = _whole(value)
    return number if number is not None and number >= 1 else None


def _machines(value: object) -> Value | None:
    match = None if isinstance(value, bool) else re.fullmatch(r"(\d+)(?::(\d+))?", str(value))
    if match is None:
        return None
    low, high = int(match.group(1)), int(match.group(2) or match.group(1))
    if low < 1 or high < low:
        return None
    return low if match.group(2) is None else f"{low}:{high}"  # "2:2" stays elastic


def _count(value: object) -> Value | None:
    number = _whole(value)
    return number if number is not None and number >= 0 else None


def _address(value: object) -> Value | None:
    return value if isinstance(value, str) and split_host_port(value) is not None else None


def _lighthouse(value: object) -> Value | None:
    if not isinstance(value, str):
        return None
    bare = value.strip().removeprefix("http://")  # torchft's own form is accepted as it is
    return bare if split_host_port(bare) is not None else None


def _bind(value: object) -> Value | None:
    """An IP address of this machine to listen on (IPv6 with or without brackets), as written."""
    if not isinstance(value, str):
        return None
    try:
        ipaddress.ip_address(value.removeprefix("[").removesuffix("]"))
    except ValueError:
        return None
    return value


def _seconds(value: object) -> Value | None:
    """A positive, finite number of seconds, written as a string (``"60"``, ``"2.5"``)."""
    seconds = positive_seconds(value)
    return f"{seconds:g}" if seconds is not None else None


def _policy(value: object) -> Value | None:
    return canonical(value) if isinstance(value, str) else None


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "nproc", ("-n", "--nproc"), "N",
        meaning="processes per node: a number, or 'auto' (all local GPUs, else 1)",
        help="processes PER NODE (torchrun's --nproc-per-node): with --nnodes 2, -n\xa04 starts "
        "8 processes in all. 'auto' (the default): one per local GPU, else 1. At most "
        f"max(64, 4 x CPU cores) unless {MAX_NPROC_VAR} says otherwise.",
        question="Processes per machine (a number, or 'auto' = all local GPUs, else 1)",
        convert=_processes, fix="give a number of processes per node (1 or more) or 'auto'",
        default="auto", example="4", choices="N|auto",
    ),
    Setting(
        "nnodes", ("--nnodes",), "N",
        meaning="machines in the job (or MIN:MAX for an elastic job)",
        help="machines in the job (MIN:MAX for an elastic job). Run the same command on each "
        "machine, with its own --node-rank.",
        question="Machines in the job",
        convert=_machines,
        fix="give a number of machines (1 or more), or MIN:MAX with 1 <= MIN <= MAX",
        default=1, example="2",
    ),
    Setting(
        "master", ("--master",), "HOST:PORT",
        meaning="HOST:PORT where the nodes meet (node 0's address), for several machines",
        help="where the machines meet (c10d rendezvous on node 0). Without it a single machine "
        "meets on 127.0.0.1, on a free port. Node 0 advertises this address to the others; "
        "each other node advertises its address on the path to it, and the workers' gloo / "
        "NCCL use that path's interface (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, unless set).",
        question="Address where the machines meet: HOST:PORT of machine 0",
        convert=_address, fix="give HOST:PORT, e.g. node0.cluster:29500 or [fe80::1]:29500",
        example="node0:29500", several_nodes_only=True,
    ),
    Setting(
        "node_rank", ("--node-rank",), "R",
        meaning="this machine's index; node 0 hosts the rendezvous at `master`",
        help="this machine's index; node 0 hosts the rendezvous and must be the --master host. "
        "Ranks are then numbered by torch's c10d rendezvous.",
        question="This machine's index (0 = the machine at that address)",
        convert=_count, fix="give a whole number, 0 or more",
        default=0, example="0", several_nodes_only=True,
    ),
    Setting(
        "mixed_precision", ("--mixed-precision",), "P",
        meaning=f"default of mixed_precision() / distributed(): {_QUOTED}",
        help="default policy of mixed_precision() / distributed() in the script (sets "
        f"{_env.MIXED_PRECISION_VAR}): {_LISTED}. A policy the script names itself wins; "
        "rank 0 then warns once, naming both.",
        question=f"Mixed precision: {_LISTED}",
        convert=_policy, fix=f"give {_QUOTED}",
        default="no", example="bf16", choices="|".join(_IN_ORDER),
    ),
    Setting(
        "max_restarts", ("--max-restarts",), "K",
        meaning="times all workers restart after one fails (0: the job ends)",
        help="restart all workers up to K times after one fails; with 0 (the default) a failed "
        "rank ends the job and is named.",
        question="Restarts of all workers after one fails",
        convert=_count, fix="give a whole number, 0 or more",
        default=0, example="1",
    ),
    Setting(
        "replica_groups", ("--replica-groups",), "R",
        meaning="fault-tolerant replica groups of -n processes each (1: none)",
        help="start R replica groups of -n processes each, and a torchft lighthouse: when a "
        "group fails the others go on at the same step, and the group (restarted with "
        "--max-restarts) heals from a live peer. With --lighthouse: the job's group count, "
        "this launcher starting one of them. Needs torchft (accel_ctx's ft extra).",
        question="Fault-tolerant replica groups (1: none)",
        convert=lambda v: n if (n := _whole(v)) is not None and n >= 1 else None,
        fix="give a whole number, 1 or more", default=1, example="2",
    ),
    Setting(
        "lighthouse", ("--lighthouse",), "HOST:PORT",
        meaning="HOST:PORT of the `accel-ctx lighthouse` the replica groups meet at",
        help="this launcher is one replica group's (--replica-group) of a job whose groups "
        "meet at the lighthouse that `accel-ctx lighthouse` runs at HOST:PORT (http:// "
        "optional), on any machine; it starts no lighthouse of its own and waits up to 30 s "
        "for that one to answer. Needs torchft (accel_ctx's ft extra).",
        question="Address of the replica groups' lighthouse: HOST:PORT",
        convert=_lighthouse, fix="give HOST:PORT, e.g. node0:29510 or http://node0:29510",
        example="node0:29510", asked=False,
    ),
    Setting(
        "lighthouse_bind", ("--lighthouse-bind",), "ADDR",
        meaning="the address the replica groups' lighthouse listens on",
        help="the address the lighthouse of --replica-groups R listens on: 127.0.0.1 (the "
        "default: its groups run on this machine), or another address of this machine, e.g. "
        "0.0.0.0 to reach its status page from elsewhere. Also the default of `accel-ctx "
        "lighthouse --bind` (there [::], every interface: groups on several machines).",
        question="Address the replica groups' lighthouse listens on",
        convert=_bind, fix="give an IP address of this machine, e.g. 127.0.0.1, 0.0.0.0 or [::]",
        example="0.0.0.0", asked=False,
    ),
    Setting(
        "replica_timeout", ("--replica-timeout",), "SEC",
        meaning="seconds a replica group waits for the lighthouse, a quorum or a peer",
        help="how long a replica group waits for the lighthouse (before its workers start "
        "too), for the first quorum's other groups, a quorum, a cross-group collective or a "
        "state transfer (default 30; ACCEL_CTX_REPLICA_TIMEOUT where neither the flag nor a "
        "config file gives it): more where groups start minutes apart, as on a busy scheduler.",
        question="Seconds a replica group waits for the lighthouse, a quorum or a peer",
        convert=_seconds, fix="give a positive number of seconds, e.g. 60",
        example="60", asked=False,
    ),
    Setting(
        "replica_group", ("--replica-group",), "I",
        meaning="this launcher's replica group, 0 to R-1 (with --lighthouse)",
        help="with --lighthouse: the index of the replica group this launcher starts (0 to "
        "R-1 for --replica-groups R); each group's launcher has its own --max-restarts.",
        question="This launcher's replica group (0 to R-1)",
        convert=_count, fix="give a whole number, 0 or more", example="0", asked=False,
    ),
)
"""Every setting, in the order of questions, help and files."""

_BY_KEY = {s.key: s for s in SETTINGS}
KEYS = tuple(_BY_KEY)
"""The setting names, as config files spell them."""


def setting(key: str) -> Setting:
    """The setting called ``key`` (a KeyError for no setting)."""
    return _BY_KEY[key]


def check(key: str, value: object, where: str) -> Value:
    """Validate one setting (from a file, a flag or an answer); return it in canonical form.

    ``where`` starts the error (a flag, ``file: key``, "answer"); the error quotes the value
    as written, never a half-converted one.

    Examples:
        >>> from accel_ctx._launch.settings import check
        >>> check("nproc", "abc", "-n")
        Traceback (most recent call last):
        ...
        accel_ctx.errors.ConfigurationError: -n: 'abc' is not valid (processes per node: ...
    """
    found = _BY_KEY.get(key)
    if found is None:
        close = difflib.get_close_matches(key, KEYS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigurationError(
            f"{where}: unknown setting {key!r}.{hint} Known settings: {', '.join(KEYS)}."
        )
    given = value.strip() if isinstance(value, str) else value
    converted = found.convert(given)
    if converted is None:
        raise ConfigurationError(f"{where}: {given!r} is not valid ({found.meaning}); {found.fix}.")
    return converted


def split_host_port(text: str) -> tuple[str, int] | None:
    """``"host:29500"`` -> ``("host", 29500)``; IPv6 in brackets; None if malformed.

    Examples:
        >>> split_host_port("[::1]:29500"), split_host_port("node0:80"), split_host_port("x")
        (('::1', 29500), ('node0', 80), None)
    """
    match = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d+)|([^\s:\[\]]+):(\d+)", text.strip())
    if match is None:
        return None
    host = match.group(1) or match.group(3)
    port = int(match.group(2) or match.group(4))
    return (host, port) if 0 < port < 65536 else None
