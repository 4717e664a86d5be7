"""launch(fn, nprocs): real child processes, rank 0's result back, failures raised with the rank."""

from __future__ import annotations

import sys
import time
import types

import pytest
import torch

from accel_ctx import launch
from accel_ctx.errors import ConfigurationError, DistributedError

from .._timeouts import scaled
from ..workers import launch_fns
from ..workers.common import params, train


def test_returns_rank_zero_value_from_a_job_distributed_can_join():
    out = launch(launch_fns.whoami, nprocs=2, args=("hello",))
    assert out["tag"] == "hello" and out["rank"] == 0 and out["world"] == 2
    assert out["sum"] == 3.0  # 1 + 2: both ranks took part in the all-reduce
    assert out["pid"] != __import__("os").getpid()


@pytest.mark.slow
def test_training_through_launch_matches_one_process_with_the_whole_batch():
    got = launch(launch_fns.train_params, nprocs=2, args=("mlp", 8))
    reference = params(train("mlp", 16))
    for key in reference:
        torch.testing.assert_close(got[key], reference[key], rtol=1e-5, atol=1e-6)


def test_exception_in_a_rank_is_raised_with_its_rank_and_traceback():
    start = time.monotonic()
    with pytest.raises(ValueError, match="bad batch") as info:
        launch(launch_fns.fail_on, nprocs=2, args=(1, "bad batch", scaled(60)))
    assert time.monotonic() - start < scaled(30)  # rank 0 was stopped, not waited for
    cause = str(info.value.__cause__)
    assert "rank 1 of 2" in cause and "fail_on" in cause and "raise ValueError" in cause
    if sys.version_info >= (3, 11):
        assert any("rank 1 of 2" in note for note in info.value.__notes__)


def test_a_rank_that_dies_ends_the_call_naming_it():
    start = time.monotonic()
    with pytest.raises(DistributedError, match=r"rank 0 of 2 died \(killed by SIGKILL\)"):
        launch(launch_fns.die_on, nprocs=2, args=(0, scaled(60)))
    assert time.monotonic() - start < scaled(30)  # rank 1 was stopped, not waited for


def test_a_dead_rank_is_noticed_even_while_its_helper_processes_live_on():
    start = time.monotonic()
    with pytest.raises(DistributedError, match="rank 1 of 2 died"):
        launch(launch_fns.die_leaving_a_child, nprocs=2, args=(1, scaled(6), scaled(60)))
    assert time.monotonic() - start < scaled(5)  # not the 6 s the helper holds the pipe open


def test_sys_exit_in_a_rank_is_reported_not_raised_as_system_exit():
    with pytest.raises(DistributedError, match=r"rank 0 of 1 raised SystemExit\(3\)"):
        launch(launch_fns.exit_with, nprocs=1, args=(3,))
    assert launch(launch_fns.exit_with, nprocs=1, args=(0,)) is None


def test_timeout_stops_the_job():
    start = time.monotonic()
    with pytest.raises(DistributedError, match=r"timeout=0\.5"):
        launch(launch_fns.sleep, nprocs=2, args=(scaled(60),), timeout=0.5)
    assert time.monotonic() - start < scaled(15)


def test_unpicklable_result_is_explained():
    with pytest.raises(DistributedError, match="returned a value that cannot be sent back"):
        launch(launch_fns.unpicklable_result, nprocs=1)


@pytest.mark.slow
def test_spawn_start_method_runs_an_importable_function():
    out = launch(launch_fns.whoami, nprocs=2, args=("spawned",), start_method="spawn")
    assert (out["tag"], out["world"], out["sum"]) == ("spawned", 2, 3.0)


def test_fork_works_with_a_function_spawn_could_not_import():
    assert launch(lambda a, b: a * b, nprocs=2, args=(6, 7)) == 42


def test_cuda_initialised_and_a_notebook_function_says_what_to_do(monkeypatch):
    notebook_main = types.ModuleType("__main__")  # an interactive __main__ has no __file__
    monkeypatch.setitem(sys.modules, "__main__", notebook_main)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)

    def train_in_notebook() -> None:
        pass

    train_in_notebook.__module__ = "__main__"
    with pytest.raises(ConfigurationError) as info:
        launch(train_in_notebook, nprocs=2)
    message = str(info.value)
    assert "CUDA is already initialised" in message and "notebook" in message
    assert "restart the kernel" in message and ".py module" in message
    with pytest.raises(ConfigurationError, match="cannot be pickled"):
        launch(lambda: None, nprocs=2)  # a lambda never survives spawn
    with pytest.raises(ConfigurationError, match="start_method='spawn'"):
        launch(launch_fns.sleep, nprocs=2, args=(0,), start_method="fork")


@pytest.mark.parametrize("bad", [0, -1, 1.5, "many", True])
def test_bad_process_count(bad):
    with pytest.raises(ConfigurationError, match="nprocs"):
        launch(launch_fns.sleep, nprocs=bad, args=(0,))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_with_cuda_initialised_here_the_ranks_are_spawned_and_use_their_gpus():
    torch.zeros(1, device="cuda")  # as a notebook cell would, before calling launch()
    world = min(2, torch.cuda.device_count())
    assert launch(launch_fns.device_of_rank, nprocs=world) == "cuda:0"


def test_max_restarts_starts_the_job_again_after_a_failure(capfd):
    out = launch(launch_fns.fail_first_attempts, nprocs=2, args=(1, 1), max_restarts=2)
    assert out == {"restart": 1, "sum": 2.0}  # the second attempt, with both ranks
    assert "attempt 1 of 3 failed" in capfd.readouterr().err


def test_exhausted_restarts_raise_the_last_failure_naming_its_rank():
    with pytest.raises(RuntimeError, match="flaky node on attempt 1") as info:  # or rank 0's
        # DistributedError naming it: whichever rank reports first
        launch(launch_fns.fail_first_attempts, nprocs=2, args=(5, 1), max_restarts=1)
    if sys.version_info >= (3, 11):
        notes = " ".join(info.value.__notes__)
        assert "rank 1 of 2" in notes and "failed 2 times (max_restarts=1)" in notes
    with pytest.raises(ConfigurationError, match="max_restarts"):
        launch(launch_fns.whoami, nprocs=1, args=("x",), max_restarts=-1)
