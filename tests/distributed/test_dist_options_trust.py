"""distributed()'s options are checked in one process too, with messages that say the fix.

Issue 11, points 12 and 13: bad option values, nested scopes that cannot take effect, a CUDA
device where there is none, and ranks that would share one GPU.
"""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
import torch

from accel_ctx import distributed, state
from accel_ctx.errors import ConfigurationError


@pytest.mark.parametrize(
    ("option", "value", "fix"),
    [
        ("bucket_cap_mb", "big", "positive number of MiB"),
        ("bucket_cap_mb", -5, "positive number of MiB"),
        ("bucket_cap_mb", math.nan, "positive number of MiB"),
        ("init_method", 5, "rendezvous URL"),
        ("init_method", "/tmp/store", "rendezvous URL"),
        ("backend", "foo", "'gloo'"),
        ("backend", "glooo", "did you mean 'gloo'"),
        ("backend", 3, "'gloo'"),
        ("backend", "cpu:gloo,cuda:foo", "'nccl'"),
        ("device", "tpu", "'cpu', 'cuda'"),
        ("device", 7.5, "'cpu', 'cuda'"),
        ("timeout", math.nan, "positive, finite number of seconds"),
        ("timeout", math.inf, "positive, finite number of seconds"),
        ("timeout", -1, "positive, finite number of seconds"),
        ("timeout", 0, "positive, finite number of seconds"),
        ("timeout", "10", "positive, finite number of seconds"),
        ("timeout", timedelta(seconds=-3), "positive, finite number of seconds"),
        ("timeout", 1e300, "positive, finite number of seconds"),
    ],
)
def test_a_bad_option_names_option_value_and_fix(option, value, fix):
    with pytest.raises(ConfigurationError) as info:
        distributed(**{option: value})
    message = str(info.value)
    assert f"distributed({option}={value!r})" in message, message
    assert fix in message, message


def test_good_options_are_kept():
    scope = distributed(bucket_cap_mb=10, init_method="file:///tmp/x", backend="GLOO",
                        device=torch.device("cpu"), timeout=timedelta(seconds=30))
    assert scope.options.bucket_cap_mb == 10.0
    assert scope.options.backend == "gloo"
    assert scope.options.device == "cpu"
    assert scope.options.timeout == timedelta(seconds=30)
    assert distributed(backend="cpu:gloo,cuda:nccl").options.backend == "cpu:gloo,cuda:nccl"
    assert distributed(timeout=2.5).options.timeout == timedelta(seconds=2.5)


@pytest.mark.parametrize(
    ("option", "value"),
    [("device", "meta"), ("backend", "nccl"), ("backend", "gloo"),
     ("init_method", "file:///tmp/elsewhere")],
)
def test_a_nested_scope_that_cannot_take_effect_raises(option, value):
    with distributed():
        with pytest.raises(ConfigurationError) as info, distributed(**{option: value}):
            pass
        message = str(info.value)
        assert f"distributed({option}={value!r}) is nested inside" in message, message
        assert "outermost distributed()" in message, message
        assert state().world_size == 1  # the outer scope is still open and fine


def test_a_nested_scope_asking_for_what_the_outer_has_is_fine():
    with distributed(device="cpu"), distributed(device="cpu", find_unused_parameters=True):
        model = torch.nn.Linear(2, 2)
        assert model(torch.ones(1, 2)).shape == (1, 2)
    with distributed(), distributed(device="cpu"):
        pass


def test_a_nested_scope_keeps_what_it_was_not_given_from_the_outer_one():
    """`sharded()` inside `distributed(timeout=60)`: the waits inside (barriers, checkpoints,
    an engine's own groups) read the job's options, which keep the outer scope's timeout and
    debug flag; what the nested scope gives is its own."""
    from accel_ctx import sharded
    from accel_ctx._kernel import state as _state

    with distributed(timeout=60, debug=True), sharded():
        options = _state.current().job.options
        assert options.timeout == timedelta(seconds=60) and options.debug
        with distributed(find_unused_parameters=True, debug=False):
            options = _state.current().job.options
            assert options.timeout == timedelta(seconds=60)
            assert options.find_unused_parameters and not options.debug


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
@pytest.mark.parametrize("world", ["1", "2"])
def test_cuda_without_cuda_says_so(monkeypatch, tmp_path, world):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("ACCEL_CTX_INIT_METHOD", f"file://{tmp_path / 'store'}")
    for device in ("cuda", "cuda:1"):
        with pytest.raises(ConfigurationError) as info, distributed(device=device, timeout=5):
            pass
        message = str(info.value)
        assert f"distributed(device={device!r})" in message, message
        assert "CUDA" in message and "device='cpu'" in message, message
        assert "backend" not in message, message


@pytest.mark.parametrize(
    ("local_world", "gpus", "env", "shared"),
    [
        (2, 1, {}, True),  # accel-ctx launch -n 2 on a one-GPU workstation
        (4, 2, {}, True),
        (4, 2, {"CUDA_VISIBLE_DEVICES": "0,1"}, True),
        (2, 1, {"CUDA_VISIBLE_DEVICES": "0,1"}, True),
        (8, 1, {"CUDA_VISIBLE_DEVICES": ""}, True),
        (2, 1, {"CUDA_VISIBLE_DEVICES": "3"}, False),  # srun --gpus-per-task=1: one GPU each
        (2, 1, {"HIP_VISIBLE_DEVICES": "1"}, False),
        (2, 2, {}, False),
        (1, 1, {}, False),
        (4, 8, {}, False),
    ],
)
def test_ranks_sharing_a_gpu_are_detected(local_world, gpus, env, shared):
    from accel_ctx._job.placement import gpu_sharing_problem

    problem = gpu_sharing_problem(local_world, gpus, env)
    assert (problem is not None) == shared, problem
    if shared:
        assert problem is not None
        assert "Duplicate GPU" in problem and "device='cpu'" in problem, problem
        assert f"accel-ctx launch -n {gpus}" in problem, problem
