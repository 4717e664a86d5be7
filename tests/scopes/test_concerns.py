"""The concern protocol: the gates run the open concerns' hooks in order, and each runtime
owns its state (steps counted once per backward across scopes; the loss scale a checkpoint
restored is the scale the next backward uses)."""

from __future__ import annotations

from contextlib import ExitStack

import torch

from accel_ctx import accumulate, distributed, load_state, mixed_precision, save_state, state
from accel_ctx._hooks.scope import Scope
from accel_ctx._kernel.concern import Concern, ForwardCall
from accel_ctx._kernel.session import OptimizerRecord, Session


class _Recording(Concern):
    slot, order = "recording", 40

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def before_forward(self, call: ForwardCall, session: Session) -> None:
        self.log.append("before_forward")

    def after_forward(self, call: ForwardCall, out: object) -> object:
        self.log.append("after_forward")
        return out

    def before_backward(self, loss: torch.Tensor, session: Session) -> torch.Tensor:
        self.log.append(f"before_backward {session.backward_calls}")
        return loss * 2  # the loss the engine differentiates

    def after_backward(self, session: Session, params: object) -> None:
        self.log.append(f"after_backward {session.backward_calls}")

    def allows_step(self, record: OptimizerRecord) -> bool:
        self.log.append("allows_step")
        return len([e for e in self.log if e == "allows_step"]) > 1  # refuse the first


class _record(Scope):
    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    def _open(self, exits: ExitStack) -> Concern:
        return _Recording(self.log)


def test_a_new_concern_plugs_in_through_the_protocol_alone():
    log: list[str] = []
    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.ones_(model.weight)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with _record(log):
        model(torch.ones(1, 2)).sum().backward()
        assert model.weight.grad is not None
        assert model.weight.grad.tolist() == [[2.0, 2.0]]  # its before_backward doubled the loss
        opt.step()  # refused by allows_step: not a step at all
        assert model.weight.tolist() == [[1.0, 1.0]]
        assert state().step == 0
        opt.step()
        assert model.weight.tolist() == [[-1.0, -1.0]]
        assert state().step == 1
    assert log == ["before_forward", "after_forward", "before_backward 0", "after_backward 1",
                   "allows_step", "allows_step"]
    model(torch.ones(1, 2)).sum().backward()  # outside the scope: no hook runs
    assert len(log) == 6


def _micro_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    for _ in range(n):
        model(torch.randn(4, 2)).sum().backward()
        opt.step()
        opt.zero_grad()


def test_steps_count_once_per_group_across_successive_accumulate_scopes():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with distributed():  # one session for both accumulate scopes
        with accumulate(2):
            _micro_steps(model, opt, 6)
        assert state().step == 3
        with accumulate(2):
            _micro_steps(model, opt, 6)
        assert state().step == 6


def test_a_restored_loss_scale_is_the_scale_of_the_next_backward(tmp_path):
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with mixed_precision("fp16", init_scale=1024.0, growth_interval=1):
        _micro_steps(model, opt, 3)  # the scale grows after each clean step
        save_state(tmp_path / "ckpt", model=model, optimizer=opt)  # applies the pending update
        saved = state().loss_scale
    assert saved is not None and saved > 1024.0
    with mixed_precision("fp16", init_scale=1024.0, growth_interval=1):
        load_state(tmp_path / "ckpt", model=model, optimizer=opt)
        assert state().loss_scale == saved  # before any backward built a GradScaler
        loss = model(torch.ones(1, 2)).sum()
        loss.backward()
        grad = model.weight.grad
        assert grad is not None
        # the gradient is still scaled by the restored scale until the step unscales it
        assert torch.allclose(grad, torch.full_like(grad, saved))
        opt.step()


def test_no_concern_defines_a_method_spelt_almost_like_a_hook():
    """A hook spelt wrong is never called; mypy's explicit-override makes every real one say
    @override, and this catches the near-misses that would override nothing."""
    import difflib
    import importlib
    import inspect
    import pkgutil

    import accel_ctx
    from accel_ctx._kernel.concern import Concern

    for info in pkgutil.walk_packages(accel_ctx.__path__, "accel_ctx."):
        if info.name.startswith(("accel_ctx._launch", "accel_ctx.cli")):
            continue
        importlib.import_module(info.name)
    hooks = {n for n, v in vars(Concern).items() if callable(v) and not n.startswith("_")}
    subclasses, todo = [], list(Concern.__subclasses__())
    while todo:
        cls = todo.pop()
        subclasses.append(cls)
        todo += cls.__subclasses__()
    assert len(subclasses) >= 4
    for cls in subclasses:
        for name, value in vars(cls).items():
            if name in hooks or name.startswith("_") or not inspect.isfunction(value):
                continue
            near = difflib.get_close_matches(name, hooks, n=1, cutoff=0.85)
            assert not near, f"{cls.__qualname__}.{name} looks like the hook {near[0]}"


def test_a_runtime_that_alone_shapes_forwards_runs_its_whole_part_at_once():
    from accel_ctx._kernel.concern import NOT_FAST, Hooks

    class Shaping(Concern):
        slot, order = "shaping", 5

        def __init__(self, answer):
            self.answer, self.calls = answer, 0

        def before_forward(self, call, session):
            self.calls += 1

        def fast_forward(self):
            return lambda stack, module, args, kwargs: self.answer

    class Counting(Concern):  # no forward hook: does not stand in the way
        slot, order = "counting", 40

        def after_backward(self, session, params):
            pass

    class AlsoShaping(Concern):
        slot, order = "also", 50

        def forward_done(self, call):
            pass

    alone = Hooks((Shaping("fast"), Counting()))
    assert alone.fast_forward is not None and alone.fast_forward(None, None, (), {}) == "fast"
    assert Hooks((Shaping("fast"), AlsoShaping())).fast_forward is None  # two shape it
    assert Hooks((AlsoShaping(),)).fast_forward is None  # offers none

    # a call the fast part hands back takes the general path: the hooks run, once
    class _open_it(Scope):
        def __init__(self, runtime):
            super().__init__()
            self.runtime = runtime

        def _open(self, exits):
            return self.runtime

    shaping = Shaping(NOT_FAST)
    with _open_it(shaping):
        out = torch.nn.Linear(2, 2)(torch.ones(1, 2))
    assert shaping.calls == 1 and out.shape == (1, 2)
    taken = Shaping("fast")
    with _open_it(taken):
        assert torch.nn.Linear(2, 2)(torch.ones(1, 2)) == "fast" and taken.calls == 0
