"""mixed_precision("bf16-true") / ("fp16-true"): the model itself in half (Fabric's "bf16-true" /
"16-true"), the same steps as the loop written over ``model.to(torch.bfloat16)`` by hand."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from accel_ctx import distributed, load_state, mixed_precision, save_model, save_state, state
from accel_ctx._job.env import MIXED_PRECISION_VAR
from accel_ctx._launch.args import plan
from accel_ctx._launch.config import read_file
from accel_ctx.cli import torchrun_arity
from accel_ctx.errors import ConfigurationError

from .._spawn import spawn
from ..workers import true_half
from ..workers.common import MLP, make_data, params
from ..workers.sharded import GPT

HALF = {"bf16-true": torch.bfloat16, "fp16-true": torch.float16}


class Net(nn.Module):
    """Floating parameters, floating buffers (BatchNorm's statistics) and an integer one."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 32)
        self.bn = nn.BatchNorm1d(32)
        self.out = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.bn(self.fc(x))))


def _param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _state_dtypes(opt: torch.optim.Optimizer) -> set[torch.dtype]:
    return {v.dtype for s in opt.state.values() for v in s.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0}


@pytest.mark.parametrize("policy", sorted(HALF))
def test_parameter_bytes_halve_exactly_at_the_first_forward_in_place(policy):
    half = HALF[policy]
    torch.manual_seed(0)
    model = Net()  # built before the scope
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)  # before the first forward
    objects = list(model.parameters())
    before = _param_bytes(model)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    with mixed_precision(policy):
        assert _param_bytes(model) == before  # nothing happens before the first forward
        loss = F.cross_entropy(model(x), y)
        assert _param_bytes(model) * 2 == before
        loss.backward()
        opt.step()
    assert all(a is b for a, b in zip(model.parameters(), objects, strict=True))
    assert all(a is b for a, b in zip(opt.param_groups[0]["params"], objects, strict=True))
    assert {p.dtype for p in model.parameters()} == {p.grad.dtype for p in objects} == {half}
    assert model.bn.running_mean.dtype == model.bn.running_var.dtype == half
    assert model.bn.num_batches_tracked.dtype == torch.int64
    assert _state_dtypes(opt) == {half}  # exp_avg and exp_avg_sq: half of fp32's bytes too
    assert all(s["step"].dtype == torch.float32 for s in opt.state.values())  # counters as made


@pytest.mark.parametrize(("policy", "optimizer"), [
    ("bf16-true", lambda p: torch.optim.AdamW(p, lr=1e-2)),
    ("fp16-true", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
])
def test_trains_as_the_loop_over_a_model_cast_by_hand_and_the_loss_falls(policy, optimizer):
    half = HALF[policy]
    torch.manual_seed(0)
    model = MLP().to(half)
    opt = optimizer(model.parameters())
    hand, hand_losses = [], []
    for _ in range(3):
        for x, y in DataLoader(make_data(), batch_size=16, shuffle=True):
            loss = F.cross_entropy(model(x.to(half)), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            hand.append(params(model))
            hand_losses.append(loss.item())
    with mixed_precision(policy):
        torch.manual_seed(0)
        model = MLP()  # built inside the scope; its optimizer made after the first forward
        made: list[torch.optim.Optimizer] = []
        scoped, losses = [], []
        for _ in range(3):
            for x, y in DataLoader(make_data(), batch_size=16, shuffle=True):  # float32 batches
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                made = made or [optimizer(model.parameters())]
                made[0].step()
                made[0].zero_grad()
                scoped.append(params(model))
                losses.append(loss.item())
        assert state().loss_scale is None  # no loss scaling, fp16-true included
    assert losses == hand_losses
    for a, b in zip(scoped, hand, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert sum(losses[-6:]) < sum(losses[:6]) * 0.97  # the last epoch's loss below the first's


class Mixed(nn.Module):
    """Token ids, float features and a float mask (keyword), as a batch brings them."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.fc = nn.Linear(8, 3)
        self.seen: list[tuple[torch.dtype, ...]] = []

    def forward(self, ids: torch.Tensor, feats: torch.Tensor, *, mask: torch.Tensor
                ) -> torch.Tensor:
        self.seen.append((ids.dtype, feats.dtype, mask.dtype))
        assert not torch.is_autocast_enabled("cpu")
        return self.fc(torch.cat([self.emb(ids).sum(1), feats], 1)) * mask


def test_float_inputs_are_cast_token_ids_kept_and_outputs_stay_half():
    model = Mixed()
    ids, feats, mask = torch.randint(0, 10, (2, 3)), torch.randn(2, 4), torch.ones(2, 1)
    with torch.autocast("cpu", dtype=torch.bfloat16), mixed_precision("bf16-true"):
        out = model(ids, feats.double(), mask=mask)  # no autocast inside, the user's neither
        with torch.no_grad():
            evaluated = model(ids, feats, mask=mask)
    with mixed_precision("bf16-true", output_dtype=torch.float32):
        asked = model(ids, feats, mask=mask)
    assert model.seen == [(torch.int64, torch.bfloat16, torch.bfloat16)] * 3
    assert out.dtype == evaluated.dtype == torch.bfloat16  # as computed: no fp32 copy
    assert asked.dtype == torch.float32


def test_an_optimizer_that_stepped_in_fp32_continues_in_half():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
    F.cross_entropy(model(x), y).backward()
    opt.step()  # fp32 state, before the scope
    with mixed_precision("bf16-true"):
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert _state_dtypes(opt) == {torch.bfloat16}
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_fp16_true_warns_that_adams_default_eps_is_zero_in_fp16():
    def first_step(**options):
        with warnings.catch_warnings(record=True) as caught, mixed_precision("fp16-true"):
            warnings.simplefilter("always")
            model = MLP()
            model(torch.randn(2, 8)).sum().backward()
            torch.optim.AdamW(model.parameters(), **options).step()
            torch.optim.SGD(model.parameters(), lr=0.1).step()
        return [(str(w.message), w.filename) for w in caught]

    [(message, where)] = first_step()
    assert "eps=1e-08" in message and "eps=0.0001" in message and where == __file__
    assert first_step(eps=1e-4) == []


@pytest.mark.parametrize(("name", "meant"), [
    ("bf16-true", "bf16-true"), ("BF16-True", "bf16-true"), ("bf16_true", "bf16-true"),
    ("fp16-true", "fp16-true"), ("16-true", "fp16-true"), ("fp16_true", "fp16-true"),
])
def test_every_spelling_means_the_same_to_the_scope_the_launcher_and_the_config_file(
        name, meant, tmp_path):
    with mixed_precision(name):
        assert state().mixed_precision == meant
    env = plan(["--mixed-precision", name, "t.py"], torchrun_arity(),
               {"XDG_CONFIG_HOME": "/nonexistent"}, gpus=lambda: 0).env
    assert env[MIXED_PRECISION_VAR] == meant
    file = tmp_path / "accel-ctx.toml"
    file.write_text(f'mixed_precision = "{name}"\n')
    assert read_file(file) == {"mixed_precision": meant}


def test_the_launchers_true_half_reaches_distributed(monkeypatch):
    monkeypatch.setenv(MIXED_PRECISION_VAR, "16-true")
    model = MLP()
    with distributed():
        assert state().mixed_precision == "fp16-true"
        out = model(torch.randn(2, 8))
    assert out.dtype == model.net[0].weight.dtype == torch.float16


def test_save_model_and_save_state_keep_half_weights_under_the_users_keys(tmp_path):
    def run(stop=None, resume=False):
        with mixed_precision("bf16-true"):
            torch.manual_seed(0)
            model = MLP()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            loader = DataLoader(make_data(), batch_size=16, shuffle=True)
            if resume:  # loaded before the first forward: into fp32, cast at the forward
                load_state(tmp_path / "ckpt", model=model, optimizer=opt, loader=loader)
            for i, (x, y) in enumerate(loader):
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                if i + 1 == stop:
                    save_state(tmp_path / "ckpt", model=model, optimizer=opt, loader=loader)
                    return None
            save_model(model, tmp_path / "model.pt")
            return params(model), _state_dtypes(opt)

    full, _ = run()
    run(stop=2)
    resumed, dtypes = run(resume=True)
    assert all(torch.equal(full[k], resumed[k]) for k in full) and dtypes == {torch.bfloat16}
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    plain = MLP()
    assert sorted(saved) == sorted(plain.state_dict())
    assert {v.dtype for v in saved.values()} == {torch.bfloat16}
    plain.load_state_dict(saved)  # a plain fp32 model loads the half weights
    assert all(torch.equal(plain.state_dict()[k], full[k].float()) for k in full)


def test_an_exception_leaves_nothing_behind():
    with pytest.raises(ValueError, match="the user's"), mixed_precision("bf16-true"):
        MLP()(torch.randn(2, 8))
        raise ValueError("the user's")
    # the autouse fixture checks: no frame, no patch, stock torch


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("true_half")
    [rank0, rank1] = spawn(true_half.run_all, 2, root, str(root), timeout=240)
    return root, rank0, rank1


def test_ddp_over_half_parameters_equals_ddp_over_model_to_bfloat16_by_hand(two_ranks):
    _, *ranks = two_ranks
    for out in ranks:
        for run in ("ddp_before", "ddp_after"):  # the optimizer made before / after the forward
            scoped = out[run]
            assert scoped["out"] == "torch.bfloat16" and scoped["state"] == ["torch.bfloat16"]
            assert scoped["policy"] == "bf16-true"
            for a, b in zip(scoped["history"], out["ddp_hand"], strict=True):
                assert all(torch.equal(a[k], b[k]) for k in a)  # bit-identical, step for step
    first, second = (out["ddp_before"]["history"][-1] for out in ranks)
    assert all(torch.equal(first[k], second[k]) for k in first)  # the ranks agree


def test_sharded_trains_half_shards_and_resumes_from_its_checkpoint(two_ranks):
    _, *ranks = two_ranks
    for out in ranks:
        full = out["sharded_full"]
        assert full["params"] == ["DTensor torch.bfloat16"] and full["state"] == ["torch.bfloat16"]
        losses = full["losses"]  # 12 steps an epoch
        assert sum(losses[-12:]) < sum(losses[:12])
        resumed = out["sharded_resumed"]["weights"]
        assert all(torch.equal(full["weights"][k], resumed[k]) for k in resumed)


def test_the_sharded_model_file_loads_into_a_plain_model(two_ranks):
    root, rank0, _ = two_ranks
    saved = torch.load(root / "model.pt", weights_only=True)
    assert {v.dtype for v in saved.values()} == {torch.bfloat16}
    plain = GPT()
    plain.load_state_dict(saved)  # the user's keys, no wrapper prefix
    weights = rank0["sharded_full"]["weights"]
    assert all(torch.equal(plain.state_dict()[k], weights[k].float()) for k in weights)


def test_an_engine_built_over_fp32_weights_is_refused(two_ranks):
    _, *ranks = two_ranks
    for out in ranks:
        assert "already has a data-parallel engine" in out["refused"]
        assert "before the model's first forward" in out["refused"]


@pytest.mark.parametrize("call", ["step", "unscale_"])
def test_fp16_true_with_your_own_grad_scaler_names_the_cause_and_the_fix(call):
    torch.manual_seed(0)
    with mixed_precision("fp16-true"):
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu")  # an AMP loop kept as it was
        x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
        scaler.scale(F.cross_entropy(model(x).float(), y)).backward()
        with pytest.raises(ConfigurationError, match=r"fp16-true.*Remove the GradScaler") as info:
            getattr(scaler, call)(opt)
    assert "Attempting to unscale FP16 gradients" in str(info.value.__cause__)
