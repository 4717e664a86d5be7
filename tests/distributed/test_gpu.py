"""CUDA paths: NCCL, CUDA autocast, device placement. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from accel_ctx import distributed, mixed_precision, state

from .._spawn import spawn
from ..workers import gpu
from ..workers.common import make_data, params, train

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


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL takes one rank "
                    "per GPU; gloo cannot carry DTensor's CUDA collectives: it crashed on one)")
def test_tensor_parallel_on_two_gpus_trains_like_one_process(tmp_path):
    """The TP path on CUDA ends where the same loop in one process on the GPU ends: fp32
    allclose; bf16 close and falling. On CUDA the optimizer's default step is foreach."""
    import torch.nn.functional as F

    from ..workers.sharded import full_weights, tokens
    from ..workers.tensor_parallel import GPT, make_optimizer

    results = spawn(gpu.tensor_parallel_on_two_gpus, 2, tmp_path, 8)
    references = {}
    for precision in ("no", "bf16"):
        with distributed(device="cuda:0"), mixed_precision(precision):
            torch.manual_seed(0)
            model = GPT()
            opt = make_optimizer(model, "sgd")
            for x, y in DataLoader(tokens(32), batch_size=8, shuffle=True):
                F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
                opt.step()
                opt.zero_grad()
            references[precision] = full_weights(model)
    for rank, result in enumerate(results):
        for precision, tolerance in (("no", 1e-4), ("bf16", 2e-2)):
            run = result[precision]
            assert run["split"] == "DTensor" and run["devices"] == [f"cuda:{rank}"]
            assert run["tp"] == (rank, 2) and run["losses"][-1] < run["losses"][0]
            for k, weight in references[precision].items():
                torch.testing.assert_close(run["weights"][k], weight, rtol=tolerance,
                                           atol=tolerance)


@pytest.mark.parametrize("meta", [False, True], ids=["built on cpu", "built on meta"])
def test_sharded_on_one_gpu_places_the_model_and_trains(meta):
    # One process: nothing to shard, but the model goes to the GPU (a meta one is made there)
    from accel_ctx import sharded

    from ..workers.sharded import GPT, tokens

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


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fp8_on_the_gpu_matches_torchaos_recipe_by_hand(compiled):
    """mixed_precision("fp8") on a GPU with float8 matmuls (compute capability 8.9+) trains as
    torchao's recipe written by hand: convert_to_float8_training, bf16 autocast, AdamW."""
    pytest.importorskip("torchao", reason="mixed_precision('fp8') needs torchao")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 matmuls need compute capability 8.9 or newer")
    from torchao.float8 import convert_to_float8_training

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.GELU(),
                             nn.Linear(64, 16))

    data = [(torch.randn(32, 64, generator=torch.Generator().manual_seed(i)),
             torch.randint(0, 16, (32,), generator=torch.Generator().manual_seed(i)))
            for i in range(8)]

    def hand() -> tuple[dict[str, torch.Tensor], list[str]]:
        model = make().cuda()
        convert_to_float8_training(model)
        net = torch.compile(model) if compiled else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for x, y in data:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(net(x.cuda()), y.cuda())
            loss.backward()
            opt.step()
            opt.zero_grad()
        return params(model), [type(m).__name__ for m in model]

    def ours() -> tuple[dict[str, torch.Tensor], list[str]]:
        with distributed(), mixed_precision("fp8"):
            model = make()
            net = torch.compile(model) if compiled else model
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            for x, y in DataLoader(data, batch_size=None):  # batches to the GPU
                F.cross_entropy(net(x), y).backward()
                opt.step()
                opt.zero_grad()
            return params(model), [type(m).__name__ for m in model]

    (reference, kinds), (scoped, scoped_kinds) = hand(), ours()
    assert scoped_kinds == kinds and kinds.count("Float8Linear") == 3
    for k in reference:
        torch.testing.assert_close(scoped[k], reference[k], rtol=1e-5, atol=1e-6)
