"""mixed_precision(): the same results as autocast + GradScaler by hand, without code changes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from accel_ctx import (
    autocast_forward,
    clip_grad_norm_,
    distributed,
    mixed_precision,
    state,
)
from accel_ctx.errors import ConfigurationError

from .._spawn import spawn
from ..workers import precision
from ..workers.common import MLP, make_data, params

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _hand_written(policy, optimizer, steps=None, clip=None):
    torch.manual_seed(0)
    model = MLP()
    opt = optimizer(model.parameters())
    scaler = torch.amp.GradScaler("cpu", enabled=policy == "fp16")
    history = []
    for i, (x, y) in enumerate(DataLoader(make_data(), batch_size=16, shuffle=True)):
        with torch.autocast("cpu", dtype=DTYPES[policy]):
            out = model(x)
        scaler.scale(F.cross_entropy(out.float(), y)).backward()
        if clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        history.append(params(model))
        if steps is not None and i + 1 == steps:
            break
    return history


def _scoped(policy, optimizer, steps=None, clip=None):
    with mixed_precision(policy):
        torch.manual_seed(0)
        model = MLP()
        opt = optimizer(model.parameters())
        history = []
        for i, (x, y) in enumerate(DataLoader(make_data(), batch_size=16, shuffle=True)):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if clip is not None:  # the user's plain torch call
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
            history.append(params(model))
            if steps is not None and i + 1 == steps:
                break
        return history


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9),
    "adam-foreach": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
    "adam-fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
}


@pytest.mark.parametrize("policy", ["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_matches_hand_written_autocast_step_for_step(policy, name):
    hand = _hand_written(policy, OPTIMIZERS[name])
    ours = _scoped(policy, OPTIMIZERS[name])
    for step, (a, b) in enumerate(zip(hand, ours, strict=True)):
        for k in a:
            assert torch.equal(a[k], b[k]), f"step {step}: {k} differs"


def test_fp16_clipping_unscales_first():
    hand = _hand_written("fp16", OPTIMIZERS["sgd"], clip=0.05)
    ours = _scoped("fp16", OPTIMIZERS["sgd"], clip=0.05)
    for a, b in zip(hand, ours, strict=True):
        for k in a:
            assert torch.equal(a[k], b[k])


@pytest.mark.parametrize("name", ["sgd", "adam-fused"])
@pytest.mark.parametrize("clip", [None, 0.05], ids=["", "clipped"])
def test_an_amp_loop_kept_as_it_was_trains_as_by_hand_under_fp16(name, clip):
    # autocast + its own GradScaler (+ scaler.unscale_ before clipping), the scope put around
    # it: the loss is scaled once, not twice (which overflowed and skipped every early step)
    hand = _hand_written("fp16", OPTIMIZERS[name], clip=clip)
    with pytest.warns(UserWarning, match="GradScaler of your own"), mixed_precision("fp16"):
        ours = _hand_written("fp16", OPTIMIZERS[name], clip=clip)
        assert state().skipped_steps == 0
    for step, (a, b) in enumerate(zip(hand, ours, strict=True)):
        for k in a:
            assert torch.equal(a[k], b[k]), f"step {step}: {k} differs"


def test_a_users_grad_scaler_defers_to_the_scopes_skips_and_scale():
    torch.manual_seed(0)
    model = MLP()
    model.net[0].weight.register_hook(InfAt({3}))
    opt = OPTIMIZERS["sgd"](model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    history, scales = [], []
    warned = pytest.warns(UserWarning, match="GradScaler of your own")
    with warned, mixed_precision("fp16", init_scale=1024.0):
        for x, y in DataLoader(make_data(), batch_size=16):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            history.append(params(model))
            scales.append(scaler.get_scale())
        assert state().skipped_steps == 1
    assert all(torch.equal(history[1][k], history[2][k]) for k in history[1])  # step 3 skipped
    assert scales[2] == 1024.0 and scales[3] == 512.0  # the scope's scale, halved once
    assert scaler.get_scale() == 2.0**10  # outside the scope the user's own, untouched


def test_fp16_clipping_twice_unscales_once():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = make_data()[:16]
    with mixed_precision("fp16"):
        for _ in range(2):  # the second round knows the optimizer, the first one does not
            F.cross_entropy(model(x), y).backward()
            first = clip_grad_norm_(model.parameters(), 1e9)
            second = clip_grad_norm_(model.parameters(), 1e9)
            grad = model.net[0].weight.grad.clone()
            opt.step()
            opt.zero_grad()
    torch.testing.assert_close(first, second)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()  # unscaled reference gradient, no scope
    assert float(first) < 100  # a true norm, not one multiplied by the 65536 scale
    assert grad.abs().max() < 100


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return spawn(precision.run_all, 2, tmp_path_factory.mktemp("prec"))


@pytest.mark.parametrize("policy", precision.RUNS)
def test_two_ranks_match_hand_written_ddp_with_autocast(two_ranks, policy):
    for rank in two_ranks:
        r = rank[policy]
        assert len(r["scoped"]) == len(r["hand"]) == 6
        for a, b in zip(r["hand"], r["scoped"], strict=True):
            for k in a:
                torch.testing.assert_close(b[k], a[k], rtol=0, atol=0)
        if policy.startswith("fp16"):
            assert r["scale"] == r["hand_scale"]


class InfAt:
    """A gradient hook that turns the gradient into inf at chosen backward passes."""

    def __init__(self, at):
        self.at, self.calls = set(at), 0

    def __call__(self, grad):
        self.calls += 1
        return torch.full_like(grad, float("inf")) if self.calls in self.at else grad


@pytest.mark.parametrize("optimizer", ["sgd", "adam-fused"])
def test_inf_gradient_skips_exactly_that_step(optimizer):
    torch.manual_seed(0)
    model = MLP()
    model.net[0].weight.register_hook(InfAt({3}))
    opt = OPTIMIZERS[optimizer](model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    history, scales, lrs = [], [], []
    with mixed_precision("fp16", init_scale=1024.0):
        for x, y in DataLoader(make_data(), batch_size=16):
            F.cross_entropy(model(x), y).backward()
            scales.append(state().loss_scale)
            opt.step()
            sched.step()
            opt.zero_grad()
            history.append(params(model))
            lrs.append(opt.param_groups[0]["lr"])
        skipped = state().skipped_steps
    assert skipped == 1
    assert all(torch.equal(history[1][k], history[2][k]) for k in history[1])  # step 3 skipped
    assert not torch.equal(history[3]["net.0.weight"], history[2]["net.0.weight"])  # training goes on
    assert scales[2] == 1024.0 and scales[3] == 512.0  # halved before the next backward
    base = OPTIMIZERS[optimizer]  # the schedule moved with the 5 real steps only
    assert lrs[-1] == pytest.approx(base(MLP().parameters()).param_groups[0]["lr"] * 0.5 ** 5)
    assert lrs[1] == lrs[2]


def test_state_snapshots_keep_the_scale_and_skips_of_their_moment():
    torch.manual_seed(0)
    model = MLP()
    model.net[0].weight.register_hook(InfAt({3}))
    opt = OPTIMIZERS["adam-fused"](model.parameters())  # skips on the device: read when asked
    snapshots = []
    with mixed_precision("fp16", init_scale=1024.0):
        for x, y in DataLoader(make_data(), batch_size=16):
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            snapshots.append(state())  # read only after the loop
    assert [s.skipped_steps for s in snapshots] == [0, 0, 1, 1, 1, 1]
    # the scale halves at the backward after the skip; each snapshot keeps its own
    assert [s.loss_scale for s in snapshots] == [1024.0] * 3 + [512.0] * 3
    assert "skipped_steps=1" in repr(snapshots[-1])


def test_several_optimizers_and_losses_per_step():
    def run(scoped):
        torch.manual_seed(0)
        a, b = nn.Linear(8, 8), nn.Linear(8, 3)
        oa = torch.optim.SGD(a.parameters(), lr=0.1)
        ob = torch.optim.Adam(b.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu")
        out = []
        for x, y in DataLoader(make_data(), batch_size=16):
            if scoped:
                h = a(x)
                F.cross_entropy(b(h), y).backward(retain_graph=True)
                (h.pow(2).mean() * 1e-3).backward()
                oa.step()
                ob.step()
            else:
                with torch.autocast("cpu", dtype=torch.float16):  # torch's recipe: the losses too
                    h = a(x)
                    main = F.cross_entropy(b(h), y)
                    aux = h.pow(2).mean() * 1e-3
                scaler.scale(main).backward(retain_graph=True)
                scaler.scale(aux).backward()
                scaler.step(oa)
                scaler.step(ob)
                scaler.update()
            oa.zero_grad()
            ob.zero_grad()
            out.append((params(a), params(b)))
        return out

    hand = run(False)
    with mixed_precision("fp16"):
        ours = run(True)
    for (ha, hb), (sa, sb) in zip(hand, ours, strict=True):
        for k in ha:
            assert torch.equal(ha[k], sa[k]) and torch.equal(hb[k], sb[k])


def test_outputs_follow_the_recipe_and_backward_and_step_are_not_autocast():
    seen = []
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    model[0].register_full_backward_hook(lambda *_: seen.append(torch.is_autocast_enabled("cpu")))

    class Watching(torch.optim.SGD):
        def step(self, closure=None):
            seen.append(torch.is_autocast_enabled("cpu"))
            return super().step(closure)

    opt = Watching(model.parameters(), lr=0.1)
    with mixed_precision("bf16"):
        out = model(torch.randn(3, 4))
        out.register_hook(lambda g: seen.append(torch.is_autocast_enabled("cpu")))
        assert out.dtype == torch.bfloat16  # what autocast made: no fp32 copy
        loss = F.cross_entropy(out, torch.tensor([0, 1, 0]))
        assert loss.dtype == torch.float32  # under the scope's autocast, as in the recipe
        loss.backward()
        opt.step()
        assert torch.is_autocast_enabled("cpu")  # back on for the next forward
        with torch.no_grad():  # evaluation: fp32, ready for .numpy()
            assert model(torch.randn(3, 4)).numpy().dtype.name == "float32"
        with mixed_precision("bf16", output_dtype=torch.float32):
            assert model(torch.randn(3, 4)).dtype == torch.float32
        with mixed_precision("bf16", output_dtype=None), torch.no_grad():
            assert model(torch.randn(3, 4)).dtype == torch.bfloat16
    assert seen == [False, False, False]
    assert not torch.is_autocast_enabled("cpu")


def test_weights_swapped_for_evaluation_are_cast_afresh_and_back():
    """An EMA-style swap between forwards, with no step in between: no stale cast is used."""
    model = nn.Linear(4, 2)
    x = torch.randn(3, 4)
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    averaged = {k: v * 0.5 for k, v in trained.items()}
    with mixed_precision("bf16"), torch.no_grad():
        first = model(x)
        model.load_state_dict(averaged)
        on_average = model(x)
        model.load_state_dict(trained)
        again = model(x)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        model.load_state_dict(averaged)
        expected = model(x).float()
    assert torch.equal(on_average, expected) and torch.equal(first, again)


def test_weights_updated_by_a_step_are_cast_afresh_at_the_next_forward():
    """The scope's autocast stays on across steps; its weight cache must not."""
    model = nn.Linear(4, 2)
    x = torch.randn(3, 4)
    with mixed_precision("bf16"):
        before = model(x)
        with torch.no_grad():
            model.weight.add_(1.0)  # any in-place change: an optimizer step, a load
        after = model(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
    assert torch.equal(after, expected) and not torch.equal(after, before)


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    @autocast_forward
    def forward(self, x):
        return self.fc(x), torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None


def test_autocast_forward_reaches_helper_threads():
    tower = Tower()
    x = torch.randn(2, 4)
    with mixed_precision("bf16"), ThreadPoolExecutor(2) as pool:
        out, dtype = pool.submit(tower.forward, x).result()
        assert dtype == torch.bfloat16 and out.dtype == torch.float32
        # plain torch.autocast is thread-local: without the decorator the thread runs in fp32
        assert pool.submit(lambda: torch.is_autocast_enabled("cpu")).result() is False
    with ThreadPoolExecutor(1) as pool:
        out, dtype = pool.submit(tower.forward, x).result()
    assert dtype is None and out.dtype == torch.float32


def test_data_parallel_replicas_run_under_the_policy():
    tower = Tower()
    dp = nn.DataParallel(tower)  # no GPU: it calls the module directly, still through forward
    with mixed_precision("bf16"):
        _, dtype = dp(torch.randn(2, 4))
    assert dtype == torch.bfloat16


def test_unsupported_device_says_so():
    with pytest.raises(ConfigurationError, match=r"cannot run here.*'meta'"), distributed(device="meta"), mixed_precision("fp16"):
        pass


def test_launcher_default_policy(monkeypatch):
    monkeypatch.setenv("ACCEL_CTX_MIXED_PRECISION", "bf16")
    model = nn.Linear(4, 4)
    with mixed_precision():
        assert state().mixed_precision == "bf16"
    with distributed():  # documented: distributed() also follows the launcher's policy ...
        assert state().mixed_precision == "bf16"
        with mixed_precision("no"):  # ... unless a mixed_precision scope says otherwise
            assert state().mixed_precision == "no"
            assert not torch.is_autocast_enabled("cpu")
        model(torch.randn(2, 4))
    monkeypatch.setenv("ACCEL_CTX_MIXED_PRECISION", "fp4")
    with pytest.raises(ConfigurationError, match="fp4"), mixed_precision():
        pass


@pytest.mark.parametrize(("policy", "absent", "present"), [
    ("bf16", {"before_backward", "skips_step"}, {"backward_context", "before_step", "after_step"}),
    ("fp16", set(), {"before_backward", "skips_step", "backward_context", "after_step"}),
    ("no", {"before_backward", "skips_step", "backward_context", "before_step", "after_step"},
     {"forward_context"}),
])
def test_a_policy_runs_no_hook_of_its_own_that_would_do_nothing_each_step(policy, absent, present):
    # each hook runs every step; fp16 alone scales the loss, "no" switches no autocast
    from accel_ctx._kernel import state as _state
    from accel_ctx._precision.runtime import PrecisionRuntime

    with mixed_precision(policy):
        stack = _state.current()
        runtime = stack.find(PrecisionRuntime)
        ours = {hook for hook in runtime.HOOKS
                if any(getattr(h, "__self__", None) is runtime for h in getattr(stack.hooks, hook))}
    assert not ours & absent, ours & absent
    assert present <= ours, present - ours
