"""ACCEL_CTX_DEVICE picks the device when distributed() names none (CPU semantics on GPU hosts)."""

from __future__ import annotations

import os

import pytest
import torch

from accel_ctx import distributed, state
from accel_ctx.errors import ConfigurationError


def test_tests_of_cpu_semantics_are_pinned_to_the_cpu():
    # conftest pins every test that is not marked `gpu`: on a one-GPU workstation several spawned
    # ranks would otherwise share cuda:0 under NCCL ("Duplicate GPU detected").
    assert os.environ["ACCEL_CTX_DEVICE"] == "cpu"
    with distributed():
        assert state().device == torch.device("cpu")


def test_a_device_that_is_no_device_names_the_variable(monkeypatch):
    monkeypatch.setenv("ACCEL_CTX_DEVICE", "tpu")
    with pytest.raises(ConfigurationError, match=r"ACCEL_CTX_DEVICE='tpu' is not a device"), \
            distributed():
        pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_asked_for_by_the_variable_without_cuda_says_so(monkeypatch):
    monkeypatch.setenv("ACCEL_CTX_DEVICE", "cuda")
    with pytest.raises(ConfigurationError, match="CUDA"), distributed():
        pass


def test_the_scopes_own_device_option_wins_over_the_variable(monkeypatch):
    monkeypatch.setenv("ACCEL_CTX_DEVICE", "cuda:7")
    with distributed(device="cpu"):
        assert state().device == torch.device("cpu")
