"""local_sgd(): Local SGD and DiLoCo equal the same algorithms written by hand, on 2 ranks."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from accel_ctx import distributed, load_state, local_sgd, save_state, sharded
from accel_ctx.errors import ArgumentError, ConfigurationError

from .._spawn import spawn
from ..workers import local_sgd as worker
from ..workers.common import MLP, make_data, params


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn(worker.run_all, 2, tmp_path_factory.mktemp("local_sgd"), timeout=180)


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], **tol: float) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], **tol) for k in a)


@pytest.mark.parametrize("run", ["plain", "diloco"])
def test_every_step_equals_the_algorithm_written_by_hand(two_ranks, run):
    for rank in two_ranks:
        ours, ref = rank[run], rank["refs"][run]
        for step in range(1, worker.STEPS + 1):
            assert _close(ours["steps"][step], ref["steps"][step], atol=1e-6), (run, step)
        assert _close(ours["after_exit"], ref["after_exit"], atol=1e-6), run


def test_plain_equals_torchs_post_local_sgd_optimizer(two_ranks):
    for rank in two_ranks:
        ours, ref = rank["plain"], rank["refs"]["torch"]
        for step in range(1, worker.STEPS + 1):
            assert _close(ours["steps"][step], ref["steps"][step], atol=1e-6), step


@pytest.mark.parametrize("run", ["plain", "diloco"])
def test_ranks_step_apart_and_meet_every_h_steps_and_at_the_exit(two_ranks, run):
    first, second = (rank[run] for rank in two_ranks)
    for step in range(1, worker.STEPS + 1):
        same = _close(first["steps"][step], second["steps"][step], atol=0.0, rtol=0.0)
        assert same == (step % worker.H == 0), step  # no gradient all-reduce between syncs
    assert _close(first["after_exit"], second["after_exit"], atol=0.0, rtol=0.0)


def test_composes_with_accumulate_and_bf16(two_ranks):
    for rank in two_ranks:
        ours, ref = rank["composed"], rank["refs"]["composed"]
        for step in range(1, worker.STEPS + 1):  # a sync every H optimizer steps, not micro-batches
            assert _close(ours["steps"][step], ref["steps"][step], atol=1e-5), step
        assert _close(ours["after_exit"], ref["after_exit"], atol=1e-5)


def _train(scope: Any) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    with distributed(), scope:
        model = MLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for x, y in DataLoader(make_data(40), batch_size=4, shuffle=True):
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return params(model)


def test_one_process_plain_local_sgd_changes_nothing():
    from contextlib import nullcontext

    assert _close(_train(local_sgd(every=3)), _train(nullcontext()), atol=0.0, rtol=0.0)


def test_misuse_is_refused_with_the_fix():
    for every in (0, -1, 1.5, True):
        with pytest.raises(ConfigurationError, match="whole number >= 1"):
            local_sgd(every=every)  # type: ignore[arg-type]
    opt = torch.optim.SGD(MLP().parameters(), lr=0.1)
    with pytest.raises(ConfigurationError, match=r"functools\.partial"):
        local_sgd(every=2, outer_optimizer=opt)  # type: ignore[arg-type]
    for wrong in (lambda params, lr: torch.optim.SGD(params, lr=lr), lambda: None,
                  functools.partial(torch.optim.SGD, torch.zeros(1), lr=0.1)):
        # called as outer_optimizer(params): refused at once, not a bare TypeError at step H
        with pytest.raises(ArgumentError, match=r"cannot be called as outer_optimizer\(params\)"
                           r".*a function of one argument.*functools\.partial"):
            local_sgd(every=2, outer_optimizer=wrong)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"not a torch\.optim\.Optimizer"):
        _train(local_sgd(every=2, outer_optimizer=lambda params: None))  # type: ignore[arg-type,return-value]
    with sharded(), pytest.raises(ConfigurationError, match="sharded"), local_sgd(every=2):
        pass
    with local_sgd(every=2), sharded(), pytest.raises(ConfigurationError, match="sharded"):
        MLP()(torch.randn(2, 8)).sum().backward()  # the refusal comes at the forward


def test_diloco_in_one_process_is_its_outer_step():
    outer = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
    ours = _train(local_sgd(every=3, outer_optimizer=outer))
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    shared = [p.detach().clone() for p in model.parameters()]
    outer_opt = outer(shared)

    def sync() -> None:
        with torch.no_grad():
            for g, p in zip(shared, model.parameters(), strict=True):
                g.grad = g - p
            outer_opt.step()
            for g, p in zip(shared, model.parameters(), strict=True):
                p.copy_(g)

    for step, (x, y) in enumerate(DataLoader(make_data(40), batch_size=4, shuffle=True), 1):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if step % 3 == 0:
            sync()
    sync()  # the exit ends the period in progress (10 steps)
    assert _close(ours, params(model), atol=1e-6)


def _diloco_run(folder: Any, stop: int | None, resume: bool) -> dict[str, torch.Tensor]:
    """Steps 1..10 of DiLoCo (H=3); ``stop``: save there and stop; ``resume``: load first."""
    outer = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g))
               for _ in range(10)]
    torch.manual_seed(0)
    with distributed(), local_sgd(every=3, outer_optimizer=outer):
        model = MLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        start = load_state(folder, model=model, opt=opt).step if resume else 0
        for x, y in batches[start:stop]:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        if stop is not None:
            save_state(folder, model=model, opt=opt)
    return params(model)


def test_diloco_resumes_its_steps_global_weights_and_outer_optimizer(tmp_path):
    whole = _diloco_run(tmp_path / "none", None, resume=False)
    _diloco_run(tmp_path / "ckpt", 4, resume=False)  # saved 1 step into the second period
    assert _close(_diloco_run(tmp_path / "ckpt", None, resume=True), whole, atol=1e-6)
