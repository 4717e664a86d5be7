"""SLURM and Open MPI environments: read correctly, and recognised by distributed() for real."""

from __future__ import annotations

import pytest
import torch

from accel_ctx._job import env as _env
from accel_ctx.errors import LaunchEnvironmentError

from .._spawn import free_port, spawn
from .._timeouts import scaled
from ..workers import launch_envs
from ..workers.common import params, train

BATCH = 8


def _srun(rank: int, world: int, port: int) -> dict[str, str]:
    """What `srun -N1 -n WORLD python train.py` gives task RANK (and an exported MASTER_PORT)."""
    return {
        "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0", "SLURM_NTASKS": str(world),
        "SLURM_STEP_NUM_TASKS": str(world), "SLURM_STEP_NUM_NODES": "1", "SLURM_NNODES": "1",
        "SLURM_STEP_TASKS_PER_NODE": str(world), "SLURM_TASKS_PER_NODE": str(world),
        "SLURM_STEP_NODELIST": "localhost", "SLURM_JOB_NODELIST": "localhost",
        "MASTER_PORT": str(port),
    }


def _mpirun(rank: int, world: int, port: int) -> dict[str, str]:
    """What `mpirun -np WORLD -x MASTER_PORT python train.py` gives rank RANK on one node."""
    return {
        "OMPI_COMM_WORLD_SIZE": str(world), "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": str(world),
        "OMPI_COMM_WORLD_NODE_RANK": str(rank), "PMIX_RANK": str(rank),
        "MASTER_PORT": str(port),
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    shapes = {
        "slurm": [_srun(r, 2, free_port()) for r in range(2)],
        "mpi": [_mpirun(r, 2, free_port()) for r in range(2)],
    }
    for shape in shapes.values():  # every rank of a job agrees on the port
        for variables in shape:
            variables["MASTER_PORT"] = shape[0]["MASTER_PORT"]
    return spawn(launch_envs.train_in_shapes, 2, tmp_path_factory.mktemp("envs"), shapes, BATCH,
                 env=lambda r: {"SHAPE_INDEX": str(r), "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["slurm", "mpi"])
def test_srun_and_mpirun_ranks_form_one_job_and_train_equivalently(trained, shape):
    reference = params(train("mlp", 2 * BATCH))
    for rank, result in enumerate(trained):
        got = result[shape]
        assert (got["rank"], got["world"], got["local_rank"]) == (rank, 2, rank)
        assert got["backend"] == "gloo"
        for key in reference:
            torch.testing.assert_close(got["params"][key], reference[key], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_missing_peer_fails_within_the_timeout(tmp_path):
    variables = _srun(0, 2, free_port())
    [result] = spawn(launch_envs.lonely_rank, 1, tmp_path, variables, 3.0,
                     env=lambda r: {"OMP_NUM_THREADS": "1"})
    assert result["error"] is not None and "rank 0 of 2" in result["error"]
    assert "slurm" in result["error"] and "within 3 s" in result["error"]
    assert result["elapsed"] < scaled(30)


# ---- reading the variables (no processes) ----------------------------------------------------
def test_slurm_two_nodes():
    env = {
        "SLURM_JOB_ID": "987654", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
        "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_NODELIST": "gpu[07-08]",
    }
    launch = _env.detect(env)
    assert launch.source == "slurm"
    assert (launch.coordinates.rank, launch.coordinates.world_size, launch.coordinates.local_rank) == (5, 8, 1)
    assert (launch.coordinates.local_world_size, launch.coordinates.node_rank, launch.coordinates.num_nodes) == (4, 1, 2)
    assert (launch.master_addr, launch.master_port) == ("gpu07", 15000 + 7654)
    exported = _env.detect({**env, "MASTER_ADDR": "head", "MASTER_PORT": "1234"})
    assert (exported.master_addr, exported.master_port) == ("head", 1234)


def test_slurm_uneven_nodes_use_this_nodes_task_count():
    env = {"SLURM_PROCID": "3", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
           "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "2",
           "SLURM_STEP_TASKS_PER_NODE": "3,1", "SLURM_STEP_NODELIST": "a,b"}
    launch = _env.detect(env)
    assert (launch.coordinates.local_world_size, launch.coordinates.node_rank, launch.master_addr) == (1, 1, "a")


def test_slurm_batch_script_without_srun_is_one_process():
    # sbatch --ntasks 8 running `python train.py` itself: one process, not 8 to wait for
    env = {"SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
           "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "n[1-2]"}
    assert _env.detect(env).source == "single"


def test_launcher_variables_win_over_slurm():
    env = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "RANK": "3", "WORLD_SIZE": "4",
           "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    launch = _env.detect(env)
    assert (launch.source, launch.coordinates.rank, launch.coordinates.node_rank) == ("torchrun", 3, 1)


def test_open_mpi_across_nodes():
    env = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "MASTER_ADDR": "node0"}
    launch = _env.detect(env)
    assert (launch.source, launch.coordinates.rank, launch.coordinates.local_rank, launch.coordinates.node_rank) == ("mpi", 3, 1, 1)
    assert (launch.coordinates.num_nodes, launch.master_addr, launch.master_port) == (2, "node0", 29500)
    with pytest.raises(LaunchEnvironmentError, match="MASTER_ADDR"):
        _env.detect({k: v for k, v in env.items() if k != "MASTER_ADDR"})
    with pytest.raises(LaunchEnvironmentError, match="OMPI_COMM_WORLD_RANK"):
        _env.detect({k: v for k, v in env.items() if k != "OMPI_COMM_WORLD_RANK"})


def test_mpich_pmi():
    env = {"PMI_SIZE": "2", "PMI_RANK": "1", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    launch = _env.detect(env)
    assert (launch.source, launch.coordinates.rank, launch.coordinates.local_rank, launch.master_addr) == (
        "mpi", 1, 1, "127.0.0.1")


def test_launcher_under_srun_one_task_per_node_takes_nodes_from_slurm():
    env = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "1", "SLURM_NODEID": "1",
           "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "2",
           "SLURM_STEP_NODELIST": "node[3-4]"}
    assert _env.slurm_nodes(env) == {"nnodes": 2, "node_rank": 1, "master": "node3:15077"}
    assert _env.slurm_nodes({**env, "SLURM_STEP_NUM_TASKS": "8"}) == {}  # one task per GPU


@pytest.mark.parametrize(("spec", "hosts"), [
    ("node[01-03,7],gpu5", ["node01", "node02", "node03", "node7", "gpu5"]),
    ("r[1-2]-n[08-09]", ["r1-n08", "r1-n09", "r2-n08", "r2-n09"]),
    ("localhost", ["localhost"]),
])
def test_hostlist_expansion(spec, hosts):
    assert _env.expand_hostlist(spec) == hosts
