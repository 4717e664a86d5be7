"""Scopes and patches in one process: composition, decorators, threads, exceptions."""

from __future__ import annotations

import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel_ctx import accumulate, distributed, mixed_precision, state
from accel_ctx._engines import records as _records
from accel_ctx._hooks import patches as _patches
from accel_ctx._kernel import state as _state
from accel_ctx.errors import ConfigurationError, MisnestedScopeError

from .._timeouts import scaled
from ..conftest import assert_stock
from ..workers.common import params, train


class Probe(nn.Module):
    """Records the autocast state its forward ran under."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.seen: list[tuple[bool, torch.dtype]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((torch.is_autocast_enabled("cpu"), self.fc(x).dtype))
        return self.fc(x)


def test_import_patches_nothing():
    code = (
        "import torch, torch.utils.data as d\n"
        "from torch import nn\n"
        "from torch.optim import optimizer as o\n"
        "before = (nn.Module.__call__, torch.Tensor.backward, d.DataLoader.__iter__,"
        " d.DataLoader.__len__, torch.optim.Optimizer.zero_grad, dict(o._global_optimizer_pre_hooks),"
        " torch.nn.utils.clip_grad_norm_, sorted(nn.Module.__dict__))\n"
        "import os, threading; env, threads = dict(os.environ), threading.active_count()\n"
        "import accel_ctx\n"
        "after = (nn.Module.__call__, torch.Tensor.backward, d.DataLoader.__iter__,"
        " d.DataLoader.__len__, torch.optim.Optimizer.zero_grad, dict(o._global_optimizer_pre_hooks),"
        " torch.nn.utils.clip_grad_norm_, sorted(nn.Module.__dict__))\n"
        "assert all(a is b or a == b for a, b in zip(before, after)), 'import patched torch'\n"
        "assert dict(os.environ) == env and threading.active_count() == threads\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=scaled(120))
    assert out.stdout.strip() == "ok", out.stderr


def test_single_process_run_is_bit_identical_to_no_scope():
    reference = params(train("mlp", 16))
    with distributed():
        scoped = params(train("mlp", 16))
    assert all(torch.equal(reference[k], scoped[k]) for k in reference)


def test_stock_functions_are_back_after_an_exception():
    with pytest.raises(RuntimeError, match="boom"), distributed(), mixed_precision("bf16"), accumulate(2):
        assert _patches.installed()
        model = nn.Linear(2, 2)
        model(torch.randn(3, 2)).sum().backward()
        raise RuntimeError("boom")
    assert _state.raw() is None
    assert_stock()
    assert _records.module_record(model) is None
    assert set(vars(model)) == set(vars(nn.Linear(2, 2)))  # nothing of ours on the module


def test_innermost_precision_wins_and_nesting_restores():
    probe = Probe()
    x = torch.randn(2, 4)
    with mixed_precision("bf16"):
        probe(x)
        with mixed_precision("no"):
            probe(x)
            assert state().mixed_precision == "no"
        probe(x)
        assert state().mixed_precision == "bf16"
    probe(x)
    assert probe.seen == [(True, torch.bfloat16), (False, torch.float32), (True, torch.bfloat16), (False, torch.float32)]


def test_scopes_compose_in_any_order():
    for outer, inner in ((distributed, lambda: mixed_precision("bf16")), (lambda: mixed_precision("bf16"), distributed)):
        probe = Probe()
        with outer(), inner(), accumulate(2):
            probe(torch.randn(2, 4))
            s = state()
            assert s.distributed and s.mixed_precision == "bf16" and s.accumulation_steps == 2
        assert probe.seen == [(True, torch.bfloat16)]


def test_decorator_opens_a_fresh_scope_per_call():
    @mixed_precision("bf16")
    def step(probe: Probe) -> str:
        probe(torch.randn(2, 4))
        return state().mixed_precision

    probe = Probe()
    assert step(probe) == "bf16" and step(probe) == "bf16"
    assert step.__name__ == "step"
    assert state().mixed_precision == "no" and not _patches.installed()


def test_decorated_generator_holds_its_scope_only_while_running():
    @mixed_precision("bf16")
    def batches():
        for _ in range(2):
            yield state().mixed_precision

    gen = batches()
    assert next(gen) == "bf16"
    assert state().mixed_precision == "no"  # suspended: the caller is outside the scope
    assert next(gen) == "bf16"
    with pytest.raises(StopIteration):
        next(gen)
    assert not _patches.installed()


def test_refuses_to_decorate_a_class():
    with pytest.raises(TypeError, match="decorates functions"):
        distributed()(type("Net", (), {}))


def test_misnested_exit_is_an_error():
    outer, inner = mixed_precision("bf16"), accumulate(2)
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(MisnestedScopeError, match="reverse order"):
        outer.__exit__(None, None, None)
    assert state().mixed_precision == "bf16"  # the refused exit left the outer scope open
    inner.__exit__(None, None, None)  # the outer scope closes with it
    outer.__exit__(None, None, None)  # nothing left to do
    assert _state.raw() is None and not _patches.installed()


def test_scope_in_one_thread_does_not_touch_another_thread():
    ready, done = threading.Barrier(2), threading.Event()
    seen: dict[str, object] = {}

    def plain_loop():
        probe = Probe()
        ready.wait()
        loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2)
        seen["iterator"] = type(iter(loader)).__name__
        seen["len"] = len(loader)
        probe(torch.randn(2, 4))
        seen["probe"] = probe.seen
        seen["state"] = state()
        done.set()

    thread = threading.Thread(target=plain_loop)
    thread.start()
    with distributed(), mixed_precision("bf16"):
        ready.wait()
        done.wait(timeout=scaled(30))
    thread.join()
    assert seen["iterator"] == "_SingleProcessDataLoaderIter"
    assert seen["len"] == 4
    assert seen["probe"] == [(False, torch.float32)]
    # no scope of its own; the process's coordinates (one process here) are the facts it sees
    assert seen["state"] == state()


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@dataclass
class Batch:
    inputs: dict[str, torch.Tensor]
    pair: Pair
    name: str


class Movable:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def to(self, device: torch.device) -> Movable:
        return Movable(self.t.to(device))


def _collate(items):
    x = torch.stack([i[0] for i in items])
    return [Batch({"x": x}, Pair(x, x + 1), "b"), (Movable(x), "label", 3)]


def test_batches_and_models_reach_the_device():
    loader = DataLoader(TensorDataset(torch.randn(6, 4)), batch_size=3, collate_fn=_collate)
    with distributed(device="meta"):
        model = nn.Linear(4, 2)
        for batch, (movable, label, number) in loader:
            assert isinstance(batch, Batch) and isinstance(batch.pair, Pair)
            assert batch.inputs["x"].device.type == "meta" and batch.pair.y.device.type == "meta"
            assert movable.t.device.type == "meta" and (label, number, batch.name) == ("label", 3, "b")
            out = model(torch.randn(3, 4))  # a CPU tensor made in the loop follows the model
            assert out.device.type == "meta" and model.weight.device.type == "meta"


def test_compiled_module_works_in_scope():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    x = torch.randn(5, 4)
    expected = model(x)
    compiled = torch.compile(model, backend="aot_eager")
    with distributed():
        out = compiled(x)
        out.sum().backward()
    torch.testing.assert_close(out, expected)
    assert model[0].weight.grad is not None


def test_unknown_option_names_the_valid_ones():
    with pytest.raises(ConfigurationError, match="Did you mean 'bucket_cap_mb'"):
        distributed(bucket_cap=10)  # type: ignore[call-arg]
    with pytest.raises(ConfigurationError, match="timeout"):
        distributed(timeout=-1)


def test_nested_distributed_is_harmless():
    reference = params(train("mlp", 16, epochs=1))
    with distributed():
        outer = state()
        with distributed():
            model = train("mlp", 16, epochs=1)
            inner = state()
        assert _state.current().job is not None  # the outer scope is intact
    assert (inner.rank, inner.world_size, inner.device) == (outer.rank, outer.world_size, outer.device)
    assert all(torch.equal(v, params(model)[k]) for k, v in reference.items())


def test_loss_outside_forward_and_f_functional():
    with distributed(), mixed_precision("bf16"):
        model = nn.Linear(4, 3)
        out = model(torch.randn(2, 4))
        loss = F.cross_entropy(out, torch.tensor([0, 1]))
        assert out.dtype == torch.bfloat16 and loss.dtype == torch.float32  # torch's recipe


def test_optimizer_state_follows_the_adopted_model_to_its_device():
    model = nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()  # Adam's state now lives on the CPU, as after loading a checkpoint
    opt.zero_grad()
    with distributed(device="meta"):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        assert opt.state[model.weight]["exp_avg"].device.type == "meta"


def test_a_scope_opened_inside_a_forward_stays_inside_it():
    calls = []

    @mixed_precision("bf16")
    def helper(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return layer(x)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with mixed_precision("no"):  # turns the enclosing autocast off here
                full = self.a(x)
            calls.append(full.dtype)
            inner = helper(self.b, x)  # a decorated helper: its calls are not top-level calls
            calls.append(inner.dtype)
            return full + inner.float()

    with mixed_precision("bf16"):
        Net()(torch.randn(2, 4))
    assert calls == [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("scopes", ["distributed", "distributed+bf16"])
def test_a_modules_own_call_runs_once_per_call_of_it(scopes: str) -> None:
    # torch.compile's wrapper is such a class: its __call__ ran twice per step inside the scopes
    class Counting(nn.Linear):
        calls = 0

        def __call__(self, *args: torch.Tensor) -> torch.Tensor:
            type(self).calls += 1
            return super().__call__(*args)  # type: ignore[no-any-return]

    model = Counting(4, 2)
    with distributed(), mixed_precision("bf16" if "bf16" in scopes else "no"):
        out = model(torch.randn(3, 4))
    assert Counting.calls == 1
    assert out.dtype == (torch.bfloat16 if "bf16" in scopes else torch.float32)


def test_an_inner_side_loader_does_not_end_accumulation_groups():
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    side = DataLoader(TensorDataset(torch.ones(3, 2)), batch_size=1)
    flags = []
    with accumulate(2):
        side_iter = None
        for (x,) in DataLoader(TensorDataset(torch.ones(8, 2)), batch_size=1):
            if side_iter is None:
                side_iter = iter(side)
            extra = next(side_iter, None)
            if extra is None:  # a short side stream, restarted
                side_iter = iter(side)
                extra = next(side_iter)
            (model(x) + model(extra[0])).sum().backward()
            flags.append(state().sync_gradients)
            opt.step()
            opt.zero_grad()
        assert state().step == 4
    assert flags == [False, True] * 4
