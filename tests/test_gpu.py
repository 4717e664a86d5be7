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


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    # fused: GradScaler hands the kernel the scale and the inf flag, by hand and in the scope
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
}


@pytest.mark.parametrize("policy", ["bf16", "fp16"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_cuda_autocast_matches_hand_written(policy, optimizer):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[policy]

    def hand():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 3)).cuda()
        opt = OPTIMIZERS[optimizer](model.parameters())
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
            opt = OPTIMIZERS[optimizer](model.parameters())
            for x, y in DataLoader(make_data(), batch_size=16):
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            return params(model)

    reference, scoped = hand(), ours()
    for k in reference:
        torch.testing.assert_close(scoped[k], reference[k], rtol=0, atol=0)


@pytest.mark.parametrize("policy", ["bf16", "fp16"])
def test_no_host_sync_in_a_scoped_step(policy):
    """torch raises at any call that waits for the GPU: a step, clipping, state() wait for none."""
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    with distributed(), mixed_precision(policy):
        batches = iter(DataLoader(make_data(96), batch_size=8, pin_memory=True))
        for i in range(10):
            # from the second step on (the first adopts the model, builds the GradScaler)
            torch.cuda.set_sync_debug_mode("error" if i else "default")
            try:
                x, y = next(batches)  # pinned: copied on a side stream
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
                snapshot = state()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert x.is_cuda and loss.dtype == torch.float32
        assert snapshot.skipped_steps >= 0 and snapshot.mixed_precision == policy


def test_pinned_batches_copied_on_a_side_stream_arrive_whole():
    """The step's stream waits for the side stream's copy: a busy GPU never reads a half copy."""
    data = [(torch.full((256, 256), float(i)), torch.tensor(i)) for i in range(20)]
    with distributed():
        busy = torch.randn(4096, 4096, device="cuda")
        whole = []
        for x, i in DataLoader(data, batch_size=None, pin_memory=True):
            busy = busy @ busy  # keeps the compute stream busy while the next copy is queued
            busy = busy / busy.norm()
            assert x.is_cuda
            whole.append((x == i.to(x.device).float()).all())  # read at the end: no sync here
        assert len(whole) == 20 and bool(torch.stack(whole).all())


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
