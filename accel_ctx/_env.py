"""Reading the launch environment: torchrun / ``accel-ctx launch``, SLURM, Open MPI, or none.

Only reads ``os.environ`` (or a mapping given for tests); never writes it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import LaunchEnvironmentError

DEFAULT_PORT = 29500
# Variables the launcher sets for the scopes (see the CLI).
MIXED_PRECISION_VAR = "ACCEL_CTX_MIXED_PRECISION"
INIT_METHOD_VAR = "ACCEL_CTX_INIT_METHOD"
DEBUG_VAR = "ACCEL_CTX_DEBUG"


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as its launcher described it."""

    source: str  # "single", "torchrun", "slurm", "mpi"
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    init_method: str | None = None
    restart_count: int = 0
    use_agent_store: bool = False

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


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


def detect(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """Describe this process from the environment; no variables means one process."""
    env = os.environ if env is None else env
    if "RANK" in env or "WORLD_SIZE" in env:
        launch = _from_torchrun(env)
    elif "OMPI_COMM_WORLD_SIZE" in env or "PMI_SIZE" in env:
        launch = _from_mpi(env)
    elif "SLURM_PROCID" in env and ("SLURM_STEP_NUM_TASKS" in env or "SLURM_NTASKS" in env):
        launch = _from_slurm(env)
    else:
        launch = LaunchEnv("single", init_method=env.get(INIT_METHOD_VAR) or None)
    _validate(launch)
    return launch


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
        rank=rank,
        world_size=world,
        local_rank=local_rank if local_rank is not None else rank % max(local_world, 1),
        local_world_size=local_world,
        node_rank=node_rank if node_rank is not None else rank // max(local_world, 1),
        num_nodes=max(1, -(-world // max(local_world, 1))),
        master_addr=env.get("MASTER_ADDR") or None,
        master_port=_opt_int(env, "MASTER_PORT"),
        init_method=env.get(INIT_METHOD_VAR) or None,
        restart_count=_opt_int(env, "TORCHELASTIC_RESTART_COUNT") or 0,
        use_agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
    )


def _from_mpi(env: Mapping[str, str]) -> LaunchEnv:
    if "OMPI_COMM_WORLD_SIZE" in env:
        world = _int(env, "OMPI_COMM_WORLD_SIZE")
        rank = _int(env, "OMPI_COMM_WORLD_RANK")
        local_rank = _opt_int(env, "OMPI_COMM_WORLD_LOCAL_RANK") or 0
        local_world = _opt_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE") or world
    else:  # MPICH / Intel MPI (PMI)
        world = _int(env, "PMI_SIZE")
        rank = _int(env, "PMI_RANK")
        local_rank = _opt_int(env, "MPI_LOCALRANKID") or 0
        local_world = _opt_int(env, "MPI_LOCALNRANKS") or world
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
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        node_rank=rank // max(local_world, 1),
        num_nodes=max(1, -(-world // max(local_world, 1))),
        master_addr=addr,
        master_port=_opt_int(env, "MASTER_PORT") or DEFAULT_PORT,
        init_method=env.get(INIT_METHOD_VAR) or None,
    )


def _from_slurm(env: Mapping[str, str]) -> LaunchEnv:
    world = _int(env, "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS")
    rank = _int(env, "SLURM_PROCID")
    num_nodes = _opt_int(env, "SLURM_STEP_NUM_NODES") or _opt_int(env, "SLURM_NNODES") or 1
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    local_world = _tasks_per_node(per_node) or max(1, world // num_nodes)
    addr = env.get("MASTER_ADDR") or None
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    if addr is None:
        hosts = expand_hostlist(nodelist) if nodelist else []
        addr = hosts[0] if hosts else "127.0.0.1"
    port = _opt_int(env, "MASTER_PORT")
    if port is None:
        job = env.get("SLURM_JOB_ID", "")
        port = 15000 + int(job[-4:]) if job[-4:].isdigit() else DEFAULT_PORT
    return LaunchEnv(
        "slurm",
        rank=rank,
        world_size=world,
        local_rank=_opt_int(env, "SLURM_LOCALID") or 0,
        local_world_size=local_world,
        node_rank=_opt_int(env, "SLURM_NODEID") or 0,
        num_nodes=num_nodes,
        master_addr=addr,
        master_port=port,
        init_method=env.get(INIT_METHOD_VAR) or None,
    )


def _tasks_per_node(spec: str) -> int | None:
    """First count of SLURM's ``4(x2),3`` format: the tasks on this kind of node."""
    match = re.match(r"(\d+)", spec)
    return int(match.group(1)) if match else None


def expand_hostlist(spec: str) -> list[str]:
    """Expand SLURM's compressed host list: ``node[01-03,7],gpu5`` -> node01 node02 node03 ..."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", spec):
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if not match:
            hosts.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        for item in ranges.split(","):
            lo, _, hi = item.partition("-")
            if not hi:
                hosts.append(f"{prefix}{lo}{suffix}")
                continue
            width = len(lo)
            hosts.extend(f"{prefix}{n:0{width}d}{suffix}" for n in range(int(lo), int(hi) + 1))
    return hosts


def _validate(launch: LaunchEnv) -> None:
    where = f"{launch.source} environment"
    if launch.world_size < 1:
        raise LaunchEnvironmentError(
            f"{where}: world size {launch.world_size} < 1; set WORLD_SIZE to the process count."
        )
    if not 0 <= launch.rank < launch.world_size:
        raise LaunchEnvironmentError(
            f"{where}: rank {launch.rank} is outside 0..{launch.world_size - 1} (world size "
            f"{launch.world_size}); every process needs a distinct RANK below WORLD_SIZE."
        )
    if not 0 <= launch.local_rank < max(launch.local_world_size, 1):
        raise LaunchEnvironmentError(
            f"{where}: local rank {launch.local_rank} is outside "
            f"0..{launch.local_world_size - 1} (LOCAL_WORLD_SIZE={launch.local_world_size}); "
            "fix LOCAL_RANK / LOCAL_WORLD_SIZE or let the launcher set them."
        )
    if launch.local_world_size > launch.world_size:
        raise LaunchEnvironmentError(
            f"{where}: {launch.local_world_size} processes per node but only "
            f"{launch.world_size} in all; LOCAL_WORLD_SIZE cannot exceed WORLD_SIZE."
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
            f"{where}: world size {launch.world_size} but {' and '.join(missing)} not set, so "
            "the processes cannot find each other. Start the script with `accel-ctx launch -n "
            f"{launch.world_size} script.py` (or torchrun), or export {' and '.join(missing)}."
        )
