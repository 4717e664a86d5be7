"""Fidelity (#23) of the engines: misnested scopes, optimizer hooks under accumulation, and
sharded models with mixed parameter dtypes."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from accel_ctx import _patches, _state, accumulate, distributed, mixed_precision, sharded, state
from accel_ctx._scope import Scope
from accel_ctx.errors import MisnestedScopeError

from .conftest import assert_stock

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
