"""CUDA paths: NCCL, CUDA autocast, device placement. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from accel_ctx import distributed, mixed_precision, state

from ._spawn import spawn
from .workers import gpu
from .workers.common import make_data, params, train

pytestmark = pytest.mark.gpu


def test_model_batches_and_optimizer_state_go_to_the_gpu():
    model = nn.Linear(8, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()  # CPU state, as after loading a checkpoint before the scope
    with distributed():
        assert state().device == torch.device("cuda", 0)
        for x, y in DataLoader(make_data(), batch_size=16, pin_memory=True):
            assert x.is_cuda and y.is_cuda
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        assert model.weight.is_cuda and opt.state[model.weight]["exp_avg"].is_cuda


@pytest.mark.parametrize("policy", ["bf16", "fp16"])
def test_cuda_autocast_matches_hand_written(policy):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[policy]

    def hand():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 3)).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cuda", enabled=policy == "fp16")
        for x, y in DataLoader(make_data(), batch_size=16):
            with torch.autocast("cuda", dtype=dtype):  # torch's recipe: the loss inside
                loss = F.cross_entropy(model(x.cuda()), y.cuda())
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return params(model)

    def ours():
        with distributed(), mixed_precision(policy):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 3))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for x, y in DataLoader(make_data(), batch_size=16):
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            return params(model)

    reference, scoped = hand(), ours()
    for k in reference:
        torch.testing.assert_close(scoped[k], reference[k], rtol=0, atol=0)


def test_single_gpu_run_matches_plain_cuda_loop():
    reference = params(train("mlp", 16))  # CPU reference; GPU math may differ in the last bits
    with distributed():
        scoped = params(train("mlp", 16))
    for k in reference:
        torch.testing.assert_close(scoped[k], reference[k], rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_two_ranks_are_equivalent_and_sync_batchnorm(tmp_path):
    results = spawn(gpu.nccl_checks, 2, tmp_path)
    reference = params(train("mlp", 16))
    for r in results:
        assert r["backend"].startswith("cpu:gloo,cuda:nccl")
        for k in reference:
            torch.testing.assert_close(r["mlp"][k], reference[k], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(results[0]["bn_mean"], results[1]["bn_mean"])
    assert all(r["bn_class_after"] == "BatchNorm1d" for r in results)


@pytest.mark.parametrize("meta", [False, True], ids=["built on cpu", "built on meta"])
def test_sharded_on_one_gpu_places_the_model_and_trains(meta):
    # One process: nothing to shard, but the model goes to the GPU (a meta one is made there)
    from accel_ctx import sharded

    from .workers.sharded import GPT, tokens

    with sharded(), mixed_precision("bf16"):
        torch.manual_seed(0)
        with torch.device("meta") if meta else torch.device("cpu"):
            model = GPT()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(3):
            for x, y in DataLoader(tokens(), batch_size=8):
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        assert all(p.is_cuda for p in model.parameters())
        assert all(p.is_cuda for s in opt.state.values() for p in s.values() if p.dim() > 0)
        assert losses[-1] < losses[0]
