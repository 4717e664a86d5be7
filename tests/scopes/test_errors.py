"""Misuse and failures end with an error that names the cause and the fix; nothing hangs."""

from __future__ import annotations

import time

import pytest

from accel_ctx import accumulate, distributed, mixed_precision
from accel_ctx.errors import ConfigurationError, LaunchEnvironmentError, RendezvousError

from .._spawn import free_port
from .._timeouts import scaled


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "x", "MASTER_PORT": "1"}, "rank 2 is outside 0..1"),
        ({"RANK": "0"}, "WORLD_SIZE missing"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR and MASTER_PORT not set"),
        ({"RANK": "zero", "WORLD_SIZE": "2"}, "RANK='zero' is not an integer"),
        ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2",
          "MASTER_ADDR": "x", "MASTER_PORT": "1"}, "local rank 3 is outside 0..1"),
    ],
)
def test_inconsistent_launch_environment(monkeypatch, env, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(LaunchEnvironmentError, match=message), distributed():
        pass


def test_missing_peer_fails_within_the_timeout(monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCEL_CTX_INIT_METHOD", f"file://{tmp_path / 'store'}")
    start = time.monotonic()
    with pytest.raises(RendezvousError, match=r"rank 0 of 2.*within 2 s"), distributed(timeout=2):
        pass
    assert time.monotonic() - start < scaled(30)


def test_unreachable_rank_zero_fails_within_the_timeout(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    start = time.monotonic()
    with pytest.raises(RendezvousError, match="rank 1 of 2"), distributed(timeout=2):
        pass
    assert time.monotonic() - start < scaled(30)


def test_bad_scope_arguments():
    with pytest.raises(ConfigurationError, match="'bf16', 'fp16', 'fp8' and 'no'"):
        mixed_precision("fp4")
    with pytest.raises(ConfigurationError, match="int >= 1"):
        accumulate(2.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="at least 1"):
        accumulate(0)
    with pytest.raises(ConfigurationError, match="True or False"):
        distributed(even_batches="yes")  # type: ignore[arg-type]


def test_a_backend_this_build_lacks_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCEL_CTX_INIT_METHOD", f"file://{tmp_path / 'store'}")
    import torch.distributed as dist

    if dist.is_nccl_available():
        pytest.skip("this build has NCCL")
    with pytest.raises(ConfigurationError, match="no nccl backend"), distributed(backend="nccl"):
        pass
