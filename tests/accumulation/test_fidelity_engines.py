"""Fidelity (#23) of the engines: misnested scopes, optimizer hooks under accumulation, and
sharded models with mixed parameter dtypes."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.optim import optimizer as optim_module

from accel_ctx import accumulate, distributed, mixed_precision, sharded, state
from accel_ctx._hooks import patches as _patches
from accel_ctx._hooks.scope import Scope
from accel_ctx._kernel import state as _state
from accel_ctx.errors import ConfigurationError, MisnestedScopeError

from .._spawn import spawn
from ..conftest import assert_stock
from ..workers import fidelity_engines as fe

# ---- scopes exited out of order by hand ------------------------------------------------------
SCOPES: dict[str, Callable[[], Scope]] = {
    "distributed": distributed,
    "sharded": sharded,
    "bf16": lambda: mixed_precision("bf16"),
    "accumulate": lambda: accumulate(2),
}
PAIRS = [(a, b) for a in SCOPES for b in SCOPES if not {a, b} <= {"distributed", "sharded"}]
PAIRS += [("distributed", "sharded"), ("sharded", "distributed")]


def _all_closed() -> None:
    assert _state.raw() is None, "a scope frame is still on the stack"
    assert not _patches.installed()
    assert_stock()


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("outer, inner", PAIRS, ids=[f"{a}>{b}" for a, b in PAIRS])
def test_refused_exit_leaves_the_scopes_to_exit_in_order(outer, inner):
    a, b = SCOPES[outer](), SCOPES[inner]()
    a.__enter__()
    b.__enter__()
    with pytest.raises(MisnestedScopeError, match="reverse order"):
        a.__exit__(None, None, None)
    model = nn.Linear(3, 1)
    _step(model, torch.optim.SGD(model.parameters(), lr=0.1))  # both scopes still open
    assert state().step in (0, 1)
    with pytest.raises(MisnestedScopeError):  # asked again, still refused
        a.__exit__(None, None, None)
    b.__exit__(None, None, None)
    a.__exit__(None, None, None)
    _all_closed()


def test_refused_exit_of_three_scopes_and_by_exception():
    a, b, c = distributed(), mixed_precision("bf16"), accumulate(2)
    for s in (a, b, c):
        s.__enter__()
    try:
        raise RuntimeError("boom")
    except RuntimeError as exc:
        info = (type(exc), exc, exc.__traceback__)
    with pytest.raises(MisnestedScopeError):
        a.__exit__(*info)
    with pytest.raises(MisnestedScopeError):
        b.__exit__(*info)
    assert state().mixed_precision == "bf16" and state().accumulation_steps == 2
    c.__exit__(*info)  # the scopes whose exits were refused close with it, innermost first
    _all_closed()
    b.__exit__(*info)  # their exits, retried, have nothing left to do
    a.__exit__(*info)
    _all_closed()


def test_with_block_that_leaves_a_scope_open():
    inner = accumulate(2)
    with pytest.raises(MisnestedScopeError), distributed(), mixed_precision("bf16"):
        inner.__enter__()
    assert state().accumulation_steps == 2 and state().mixed_precision == "bf16"
    inner.__exit__(None, None, None)  # the with block's scopes close with it
    _all_closed()


def test_with_block_that_raises_and_leaves_a_scope_open():
    inner = mixed_precision("bf16")
    with pytest.raises(MisnestedScopeError) as caught, sharded():
        inner.__enter__()
        raise ValueError("user error")
    assert isinstance(caught.value.__context__, ValueError)
    inner.__exit__(None, None, None)
    _all_closed()


def test_decorated_function_that_leaves_a_scope_open():
    inner = mixed_precision("bf16")

    @distributed()
    @accumulate(2)
    def leaks() -> None:
        inner.__enter__()

    with pytest.raises(MisnestedScopeError):
        leaks()
    assert state().accumulation_steps == 2
    inner.__exit__(None, None, None)
    _all_closed()


def test_decorated_function_that_exits_an_outer_scope_out_of_order():
    outer = distributed()

    @mixed_precision("bf16")
    def exits_outer() -> str:
        with pytest.raises(MisnestedScopeError):
            outer.__exit__(None, None, None)
        return state().mixed_precision

    outer.__enter__()
    assert exits_outer() == "bf16"
    outer.__exit__(None, None, None)  # its exit took effect when the decorated call returned
    _all_closed()


def test_decorated_generator_that_leaves_a_scope_open_across_a_yield():
    inner = accumulate(2)

    @mixed_precision("bf16")
    def batches():
        inner.__enter__()
        yield 1

    with pytest.raises(MisnestedScopeError):
        next(batches())
    assert state().mixed_precision == "bf16"
    inner.__exit__(None, None, None)
    _all_closed()


def test_exit_without_entry_is_still_an_error():
    with pytest.raises(MisnestedScopeError, match="more often than it was entered"):
        distributed().__exit__(None, None, None)
    _all_closed()


# ---- optimizer hooks and steps that accumulate(k) holds back ---------------------------------
class HookLog:
    """Hooks a script or a library registers on an optimizer: counters and an EMA updater."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.counts = {"pre": 0, "post": 0, "global_pre": 0, "global_post": 0}
        self.ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.model = model
        self.handles = [opt.register_step_pre_hook(self._count("pre")),
                        opt.register_step_post_hook(self._ema_update),
                        optim_module.register_optimizer_step_pre_hook(self._count("global_pre"))]

    def _count(self, name: str) -> Callable[..., None]:
        def hook(*_: object) -> None:
            self.counts[name] += 1
        return hook

    def _ema_update(self, *_: object) -> None:
        self.counts["post"] += 1
        with torch.no_grad():
            for k, v in self.model.state_dict().items():
                self.ema[k].lerp_(v, 0.1)

    def register_later(self) -> None:
        """A global hook registered by other code once the scope is open (after ours)."""
        self.handles.append(
            optim_module.register_optimizer_step_post_hook(self._count("global_post")))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _accumulating_run(scoped: bool, k: int = 4, micro: int = 8, cls: type = torch.optim.AdamW
                      ) -> tuple[dict[str, int], dict[str, torch.Tensor], HookLog, float]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = cls(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # made before the scope
    log = HookLog(model, opt)
    xs = torch.randn(micro, 4, 3)
    try:
        if scoped:
            with accumulate(k):
                log.register_later()
                for x in xs:
                    model(x).pow(2).mean().backward()
                    opt.step()
                    sched.step()
                    opt.zero_grad()
                assert state().step == micro // k
        else:  # the same loop written by hand
            log.register_later()
            for i, x in enumerate(xs):
                (model(x).pow(2).mean() / k).backward()
                if (i + 1) % k == 0:
                    opt.step()
                    sched.step()
                    opt.zero_grad()
    finally:
        log.remove()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return log.counts, weights, log, opt.param_groups[0]["lr"]


class SuperStepping(torch.optim.AdamW):
    """A subclass whose step() calls super().step(): torch runs the hooks at both levels."""

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        return super().step(closure)


@pytest.mark.parametrize("cls", [torch.optim.AdamW, SuperStepping], ids=["AdamW", "subclass"])
def test_optimizer_hooks_run_only_for_the_steps_accumulate_lets_through(cls):
    ours, ours_weights, ours_log, ours_lr = _accumulating_run(True, cls=cls)
    hand, hand_weights, hand_log, hand_lr = _accumulating_run(False, cls=cls)
    per_step = 2 if cls is SuperStepping else 1
    assert hand == {"pre": 2 * per_step, "post": 2 * per_step, "global_pre": 2 * per_step,
                    "global_post": 2 * per_step}
    assert ours == hand  # 8 step() calls, 2 real steps: the hooks ran for those 2 only
    for name, value in hand_weights.items():
        torch.testing.assert_close(ours_weights[name], value, rtol=1e-6, atol=1e-7)
    for name, value in hand_log.ema.items():
        torch.testing.assert_close(ours_log.ema[name], value, rtol=1e-6, atol=1e-7)
    assert ours_lr == hand_lr == 0.05 * 0.5 ** 2


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "adam-fused"])
def test_a_step_that_overflows_in_fp16_runs_the_hooks_grad_scaler_runs(fused):
    # GradScaler.step skips an overflowing step without calling optimizer.step() (no hook
    # runs); a fused optimizer is called with the inf flag and skips itself (its hooks run)
    from ..precision.test_precision import InfAt

    def run(scoped: bool) -> tuple[dict[str, int], dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
        model[0].weight.register_hook(InfAt({2}))
        opt = (torch.optim.Adam(model.parameters(), lr=0.01, fused=True) if fused
               else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        log = HookLog(model, opt)
        log.register_later()
        xs = torch.randn(5, 4, 3)
        try:
            if scoped:
                with mixed_precision("fp16", init_scale=1024.0):
                    for x in xs:
                        model(x).float().pow(2).mean().backward()
                        opt.step()
                        opt.zero_grad()
                    assert state().skipped_steps == 1
            else:
                scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
                for x in xs:
                    with torch.autocast("cpu", dtype=torch.float16):
                        out = model(x)
                    scaler.scale(out.float().pow(2).mean()).backward()
                    scaler.step(opt)
                    scaler.update()
                    opt.zero_grad()
        finally:
            log.remove()
        return log.counts, {n: p.detach().clone() for n, p in model.named_parameters()}

    ours, ours_weights = run(True)
    hand, hand_weights = run(False)
    calls = 5 if fused else 4
    assert hand == {"pre": calls, "post": calls, "global_pre": calls, "global_post": calls}
    assert ours == hand
    for name, value in hand_weights.items():
        torch.testing.assert_close(ours_weights[name], value, rtol=0, atol=0)


# ---- sharded models whose parameters mix dtypes ----------------------------------------------
BATCH = 4


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def mixed_runs(request, tmp_path_factory):
    world = request.param
    root = tmp_path_factory.mktemp("mixed")
    return world, root, spawn(fe.mixed_dtypes, world, root, BATCH, str(root), timeout=300)


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str,
           **tolerance: float) -> None:
    assert sorted(got) == sorted(want), what
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, msg=f"{what}: {key}", **tolerance)


def test_mixed_dtypes_without_a_precision_scope_are_refused_with_the_fix(mixed_runs):
    _, _, per_rank = mixed_runs
    for result in per_rank:
        message = result["refused"]
        assert message is not None and message.startswith("sharded() cannot shard this Mixed")
        assert "torch.bfloat16 (h.0.fc)" in message and "torch.float32 (h.0.ln)" in message
        assert "model.float()" in message and "mixed_precision('bf16')" in message
        assert result["refused_left"] == ["bfloat16", "float32"]


def test_mixed_dtypes_train_as_the_model_upcast_by_hand(mixed_runs):
    world, _, per_rank = mixed_runs
    for rank, result in enumerate(per_rank):
        for run in ("auto", "auto_after"):  # the optimizer made before or after the first call
            ours = result[run]
            # as the model made fp32 by hand, in the same scopes, and as FSDP2 written by hand
            for reference in ("by_hand", "fsdp_by_hand"):
                _close(ours["weights"], result[reference]["weights"],
                       f"rank {rank}: {run} vs {reference}", rtol=0, atol=0)
            assert ours["step"] == result["by_hand"]["step"] == 48 // (BATCH * world)
            assert ours["master"] == ours["state_dict"] == ours["opt_state"] == ["float32"]
            assert ours["opt_follows"]
    assert len(per_rank[0]["warned"]) == 1 and "float32 master weights" in per_rank[0]["warned"][0]
    assert all(not r["warned"] for r in per_rank[1:])  # rank 0 only


def test_mixed_dtypes_save_fp32_weights_and_resume(mixed_runs):
    _, root, per_rank = mixed_runs
    saved = torch.load(root / "model.pt", weights_only=True)
    assert {v.dtype for v in saved.values()} == {torch.float32}
    _close(saved, per_rank[0]["auto"]["weights"], "save_model", rtol=0, atol=0)
    for result in per_rank:
        _close(result["resumed"], result["auto"]["weights"], "load_state", rtol=0, atol=0)
        assert result["resumed_opt_state"] == ["float32"]
        assert result["resumed_step"] == result["auto"]["step"] + 1


def test_mixed_dtypes_in_one_process_as_on_many():
    with pytest.raises(ConfigurationError, match="cannot shard this Mixed"), sharded():
        fe.mixed_model()(torch.randn(2, 6))
    # sharded() with mixed_precision in one process: upcast too (the same loop at every scale)
    with pytest.warns(UserWarning, match="float32 master weights"):
        ours = fe.train(BATCH * 2, scope="one process")
    by_hand = fe.train(BATCH * 2, upcast=True, scope="one process")
    autocast = fe.train(BATCH * 2, scope="autocast")  # the AMP recipe on the model made fp32
    for reference in (by_hand, autocast):
        _close(ours["weights"], reference["weights"], "one process", rtol=0, atol=0)
    assert ours["master"] == ours["opt_state"] == ["float32"]


def test_uniform_or_frozen_dtypes_are_left_as_they_are():
    with sharded(), mixed_precision("bf16"):
        model = fe.mixed_model()
        model.requires_grad_(False)
        model.norm.requires_grad_(True)  # only fp32 parameters train: nothing to upcast
        model(torch.randn(2, 6))
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16, torch.float32}


def test_an_optimizer_state_made_before_the_upcast_follows_it():
    model = fe.mixed_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x, y = fe.data()[:8]
    torch.nn.functional.cross_entropy(model(x), y).backward()  # a first step before the scope
    opt.step()
    opt.zero_grad()
    before = {name: opt.state[p]["exp_avg"].clone() for name, p in model.named_parameters()}
    with sharded(), mixed_precision("bf16"), pytest.warns(UserWarning, match="master weights"):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        params = dict(model.named_parameters())
        assert {id(p) for p in opt.param_groups[0]["params"]} == {id(p) for p in params.values()}
        for name, p in params.items():
            state = opt.state[p]
            assert p.dtype == state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
            assert not torch.equal(state["exp_avg"], before[name].float())  # it stepped on
