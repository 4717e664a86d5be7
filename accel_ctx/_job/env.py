"""Reading the launch environment: torchrun / ``accel-ctx launch``, SLURM, Open MPI, or none.

Only reads ``os.environ`` (or a mapping given for tests); never writes it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

from .._options import positive_seconds
from ..errors import LaunchEnvironmentError
from .coordinates import SINGLE, Coordinates

DEFAULT_PORT = 29500
# Variables the launcher sets for the scopes (see the CLI).
MIXED_PRECISION_VAR = "ACCEL_CTX_MIXED_PRECISION"
INIT_METHOD_VAR = "ACCEL_CTX_INIT_METHOD"
DEBUG_VAR = "ACCEL_CTX_DEBUG"
# Replica groups (``accel-ctx launch --replica-groups R``): torchft's own names, as its
# train_ddp.py example reads them, so a script written for torchft sees the same variables.
LIGHTHOUSE_VAR = "TORCHFT_LIGHTHOUSE"
REPLICA_GROUP_VAR = "REPLICA_GROUP_ID"
REPLICA_GROUPS_VAR = "NUM_REPLICA_GROUPS"
REPLICA_TIMEOUT_VAR = "ACCEL_CTX_REPLICA_TIMEOUT"
REPLICA_TIMEOUT_DEFAULT = 30.0
# A folder the group's launcher watches: each worker marks there that its group's runtime opened
REPLICA_MARKS_VAR = "ACCEL_CTX_REPLICA_MARKS"


def seconds_from(name: str, purpose: str, error: type[Exception] = LaunchEnvironmentError,
                 env: Mapping[str, str] | None = None) -> float | None:
    """The environment variable ``name`` as a positive, finite number of seconds; None where it
    is unset or empty. Anything else raises ``error`` naming the variable, its value and
    ``purpose`` (what the seconds are for)."""
    text = (os.environ if env is None else env).get(name, "")
    if not text:
        return None
    seconds = positive_seconds(text)
    if seconds is None:
        raise error(f"{name}={text!r}: give a positive number of seconds {purpose}.")
    return seconds



def replica_timeout(env: Mapping[str, str] | None = None) -> float:
    """Seconds a replica group waits for the lighthouse, a quorum, the first quorum's other
    groups, a cross-group collective or a state transfer: ``ACCEL_CTX_REPLICA_TIMEOUT``, else 30
    (more where groups start minutes apart, as on a busy scheduler)."""
    seconds = seconds_from(REPLICA_TIMEOUT_VAR, f"(default {REPLICA_TIMEOUT_DEFAULT:g}) for the "
                           "replica groups' quorums and transfers", env=env)
    return REPLICA_TIMEOUT_DEFAULT if seconds is None else seconds


def replica_marks(env: Mapping[str, str] | None = None) -> str | None:
    """The folder where a replica group's worker marks that it joined its group
    (``ACCEL_CTX_REPLICA_MARKS``, set by the group's launcher); None where it is unset.

    >>> replica_marks({"ACCEL_CTX_REPLICA_MARKS": "/tmp/marks"})
    '/tmp/marks'
    """
    return (os.environ if env is None else env).get(REPLICA_MARKS_VAR) or None


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as its launcher described it."""

    source: str  # "single", "torchrun", "slurm", "mpi"
    coordinates: Coordinates = SINGLE
    master_addr: str | None = None
    master_port: int | None = None
    init_method: str | None = None
    restart_count: int = 0
    use_agent_store: bool = False
    replica_group: int = 0
    """This process's replica group (``REPLICA_GROUP_ID``): 0 without replica groups."""
    replica_groups: int = 1
    """Replica groups the job was started with (``NUM_REPLICA_GROUPS``)."""
    lighthouse: str | None = None
    """The torchft lighthouse the replica groups meet at (``TORCHFT_LIGHTHOUSE``); None: none."""

    @property
    def is_distributed(self) -> bool:
        return self.coordinates.world_size > 1


def _int(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise LaunchEnvironmentError(
            f"environment variable {name}={value!r} is not an integer; unset it or set a number."
        ) from None


def _opt_int(env: Mapping[str, str], name: str) -> int | None:
    return _int(env, name) if env.get(name, "") != "" else None


def _require(env: Mapping[str, str], launcher: str, *names: str) -> None:
    missing = [n for n in names if env.get(n, "") == ""]
    if missing:
        raise LaunchEnvironmentError(
            f"{launcher} environment without {' and '.join(missing)}: the launcher sets "
            f"{', '.join(names)} together. Start the script with that launcher, or unset the "
            "stray variables to run one process."
        )


def detect(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """Describe this process from the environment; no variables means one process."""
    env = os.environ if env is None else env
    if "RANK" in env or "WORLD_SIZE" in env:
        launch = _from_torchrun(env)
    elif "OMPI_COMM_WORLD_SIZE" in env or "PMI_SIZE" in env:
        launch = _from_mpi(env)
    elif "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        # Only srun sets the SLURM_STEP_* variables. A batch script that runs ``python
        # train.py`` itself also sees SLURM_NTASKS and SLURM_PROCID=0, yet it is one process:
        # taking SLURM_NTASKS there would wait for peers that were never started.
        launch = _from_slurm(env)
    else:
        launch = LaunchEnv("single", init_method=env.get(INIT_METHOD_VAR) or None)
    if env.get(LIGHTHOUSE_VAR, ""):
        launch = _with_replica_groups(launch, env)
    _validate(launch)
    return launch


def _with_replica_groups(launch: LaunchEnv, env: Mapping[str, str]) -> LaunchEnv:
    group = _opt_int(env, REPLICA_GROUP_VAR) or 0
    groups = _opt_int(env, REPLICA_GROUPS_VAR) or 1
    if not 0 <= group < groups:
        raise LaunchEnvironmentError(
            f"{REPLICA_GROUP_VAR}={group} with {REPLICA_GROUPS_VAR}={groups}: a replica group's "
            f"index runs from 0 to {groups - 1}. Start the groups with `accel-ctx launch "
            "--replica-groups R`, or set both variables consistently.")
    return replace(launch, replica_group=group, replica_groups=groups,
                   lighthouse=env[LIGHTHOUSE_VAR])


def _from_torchrun(env: Mapping[str, str]) -> LaunchEnv:
    missing = [v for v in ("RANK", "WORLD_SIZE") if v not in env]
    if missing:
        raise LaunchEnvironmentError(
            f"{' and '.join(missing)} missing while "
            f"{'RANK' if 'RANK' in env else 'WORLD_SIZE'} is set: a launcher sets both. Start the "
            "script with `accel-ctx launch` or torchrun, or unset the stray variable."
        )
    world = _int(env, "WORLD_SIZE")
    local_world = _opt_int(env, "LOCAL_WORLD_SIZE") or world
    local_rank = _opt_int(env, "LOCAL_RANK")
    rank = _int(env, "RANK")
    node_rank = _opt_int(env, "GROUP_RANK")
    return LaunchEnv(
        "torchrun",
        Coordinates.of(rank, world, local_rank, local_world, node_rank),
        master_addr=env.get("MASTER_ADDR") or None,
        master_port=_opt_int(env, "MASTER_PORT"),
        init_method=env.get(INIT_METHOD_VAR) or None,
        restart_count=_opt_int(env, "TORCHELASTIC_RESTART_COUNT") or 0,
        use_agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
    )


def _from_mpi(env: Mapping[str, str]) -> LaunchEnv:
    if "OMPI_COMM_WORLD_SIZE" in env:  # Open MPI's mpirun
        names = ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                 "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")
    else:  # MPICH / Intel MPI (Hydra's PMI)
        names = ("PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
    size_var, rank_var, local_rank_var, local_size_var = names
    _require(env, "MPI", size_var, rank_var)
    world = _int(env, size_var)
    rank = _int(env, rank_var)
    local_world = _opt_int(env, local_size_var)
    local_rank = _opt_int(env, local_rank_var)
    if local_world is None or local_rank is None:  # no per-node layout given: one node
        local_world, local_rank = world, rank
    addr = env.get("MASTER_ADDR") or None
    if addr is None and local_world == world:
        addr = "127.0.0.1"  # every rank is on this node
    if addr is None:
        raise LaunchEnvironmentError(
            f"MPI launch across nodes (world size {world}, {local_world} per node) but "
            "MASTER_ADDR is not set: export MASTER_ADDR=<host of rank 0> (and MASTER_PORT) "
            "to every rank, e.g. `mpirun -x MASTER_ADDR=node0 -x MASTER_PORT=29500 ...`."
        )
    return LaunchEnv(
        "mpi",
        Coordinates.of(rank, world, local_rank, local_world),  # mpirun fills nodes in blocks
        master_addr=addr,
        master_port=_opt_int(env, "MASTER_PORT") or DEFAULT_PORT,
        init_method=env.get(INIT_METHOD_VAR) or None,
    )


def _from_slurm(env: Mapping[str, str]) -> LaunchEnv:
    world = _int(env, "SLURM_STEP_NUM_TASKS")
    rank = _int(env, "SLURM_PROCID")
    node_rank = _opt_int(env, "SLURM_NODEID") or 0
    num_nodes = _opt_int(env, "SLURM_STEP_NUM_NODES") or _opt_int(env, "SLURM_NNODES") or 1
    per_node = tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or "")
    # the count for this node; an even split when SLURM's layout is missing or unreadable
    local_world = per_node[node_rank] if node_rank < len(per_node) else max(1, world // num_nodes)
    local_rank = _opt_int(env, "SLURM_LOCALID")
    if local_rank is None:
        local_rank = rank % local_world
    master = slurm_master(env)
    return LaunchEnv(
        "slurm",
        Coordinates.of(rank, world, local_rank, local_world, node_rank, num_nodes),
        master_addr=master[0],
        master_port=master[1],
        init_method=env.get(INIT_METHOD_VAR) or None,
    )


def slurm_master(env: Mapping[str, str]) -> tuple[str, int]:
    """Rank 0's host and a port every task of a SLURM step agrees on without talking.

    MASTER_ADDR / MASTER_PORT win when exported. Otherwise the host is the first node of the
    step (srun places task 0 there) and the port is derived from the job id, so two jobs that
    share a node do not pick the same port.

    Examples:
        >>> slurm_master({"SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123456"})
        ('gpu07', 18456)
    """
    addr = env.get("MASTER_ADDR") or None
    if addr is None:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
        hosts = expand_hostlist(nodelist) if nodelist else []
        addr = hosts[0] if hosts else "127.0.0.1"
    port = _opt_int(env, "MASTER_PORT")
    if port is None:
        job = env.get("SLURM_JOB_ID", "")
        port = 15000 + int(job[-4:]) if job[-4:].isdigit() else DEFAULT_PORT
    return addr, port


def slurm_nodes(env: Mapping[str, str]) -> dict[str, object]:
    """Launcher settings when srun runs ``accel-ctx launch`` as one task per node.

    Then the nodes, this node's index and the meeting point come from SLURM, so the same
    ``srun -N2 --ntasks-per-node 1 accel-ctx launch -n 4 train.py`` works on every node.

    Examples:
        >>> slurm_nodes({"SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "2",
        ...              "SLURM_NODEID": "1", "SLURM_STEP_NODELIST": "n[1-2]"})
        {'nnodes': 2, 'node_rank': 1, 'master': 'n1:29500'}
    """
    if "RANK" in env or env.get("SLURM_STEP_NUM_TASKS", "") == "":
        return {}
    nodes = _opt_int(env, "SLURM_STEP_NUM_NODES") or 1
    if nodes < 2 or _int(env, "SLURM_STEP_NUM_TASKS") != nodes:
        return {}  # one task per process instead: distributed() reads SLURM itself
    host, port = slurm_master(env)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return {"nnodes": nodes, "node_rank": _opt_int(env, "SLURM_NODEID") or 0, "master": address}


def tasks_per_node(spec: str) -> list[int]:
    """Expand SLURM's task counts per node: ``"4(x2),3"`` -> ``[4, 4, 3]``.

    Examples:
        >>> tasks_per_node("2(x3),1")
        [2, 2, 2, 1]
    """
    counts: list[int] = []
    for item in filter(None, spec.split(",")):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            return []  # a format we do not know: fall back to an even split
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def expand_hostlist(spec: str) -> list[str]:
    """Expand SLURM's compressed host list, in order (brackets may repeat in one name).

    Examples:
        >>> expand_hostlist("node[01-03,7],gpu5")
        ['node01', 'node02', 'node03', 'node7', 'gpu5']
        >>> expand_hostlist("r[1-2]-n[1-2]")
        ['r1-n1', 'r1-n2', 'r2-n1', 'r2-n2']
    """
    hosts: list[str] = []
    for name in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", spec):
        hosts.extend(_expand_name(name.strip()))
    return hosts


def _expand_name(name: str) -> list[str]:
    match = re.match(r"([^\[]*)\[([^\]]*)\](.*)", name)
    if match is None:
        return [name] if name else []
    prefix, ranges, rest = match.groups()
    heads: list[str] = []
    for item in ranges.split(","):
        lo, _, hi = item.strip().partition("-")
        if not hi:
            heads.append(prefix + lo)
        else:  # keep the zero padding of the lower bound: node[08-10] -> node08 .. node10
            heads.extend(f"{prefix}{n:0{len(lo)}d}" for n in range(int(lo), int(hi) + 1))
    return [head + tail for head in heads for tail in _expand_name(rest) or [""]]


def _validate(launch: LaunchEnv) -> None:
    where = f"{launch.source} environment"
    if launch.coordinates.world_size < 1:
        raise LaunchEnvironmentError(
            f"{where}: world size {launch.coordinates.world_size} < 1; set WORLD_SIZE to the process count."
        )
    if not 0 <= launch.coordinates.rank < launch.coordinates.world_size:
        raise LaunchEnvironmentError(
            f"{where}: rank {launch.coordinates.rank} is outside 0..{launch.coordinates.world_size - 1} (world size "
            f"{launch.coordinates.world_size}); every process needs a distinct RANK below WORLD_SIZE."
        )
    if not 0 <= launch.coordinates.local_rank < max(launch.coordinates.local_world_size, 1):
        raise LaunchEnvironmentError(
            f"{where}: local rank {launch.coordinates.local_rank} is outside "
            f"0..{launch.coordinates.local_world_size - 1} (LOCAL_WORLD_SIZE={launch.coordinates.local_world_size}); "
            "fix LOCAL_RANK / LOCAL_WORLD_SIZE or let the launcher set them."
        )
    if launch.coordinates.local_world_size > launch.coordinates.world_size:
        raise LaunchEnvironmentError(
            f"{where}: {launch.coordinates.local_world_size} processes per node but only "
            f"{launch.coordinates.world_size} in all; LOCAL_WORLD_SIZE cannot exceed WORLD_SIZE."
        )
    if launch.is_distributed and launch.init_method is None and (
        launch.master_addr is None or launch.master_port is None
    ):
        missing = [
            n
            for n, v in (("MASTER_ADDR", launch.master_addr), ("MASTER_PORT", launch.master_port))
            if v is None
        ]
        raise LaunchEnvironmentError(
            f"{where}: world size {launch.coordinates.world_size} but {' and '.join(missing)} not set, so "
            "the processes cannot find each other. Start the script with `accel-ctx launch -n "
            f"{launch.coordinates.world_size} script.py` (or torchrun), or export {' and '.join(missing)}."
        )
