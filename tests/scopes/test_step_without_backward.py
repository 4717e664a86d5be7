"""A step the scope cannot count: ``torch.autograd.backward(loss)`` is not intercepted, so a
loop written with it would see ``state().step`` stand still (a ``while state().step < N`` loop
never ends). The second step with no ``loss.backward()`` between says so, once; the loops that
do call it say nothing."""

from __future__ import annotations

import warnings

import pytest
import torch

from accel_ctx import distributed, state


class Nested(torch.optim.SGD):
    """A subclass whose step() calls super().step(): one step, not two."""

    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        return super().step(closure)


def _train(backward: str, steps: int = 3, optimizers: int = 1) -> tuple[list[str], int]:
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with distributed():
            model = torch.nn.Linear(4, 1)
            opts = [Nested(model.parameters(), lr=0.1) for _ in range(optimizers)]
            for _ in range(steps):
                loss = model(torch.randn(2, 4)).sum()
                if backward == "autograd":
                    torch.autograd.backward(loss)
                else:
                    loss.backward()
                for opt in opts:  # several optimizers after one backward: one step each
                    opt.step()
                    opt.zero_grad()
            step = state().step
    return [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)], step


def test_steps_after_torch_autograd_backward_say_the_step_count_stands_still_once() -> None:
    said, step = _train("autograd")
    assert step == 1  # what the warning is about
    assert len(said) == 1 and "torch.autograd.backward() and torch.autograd.grad are not seen" \
        in said[0] and "Call loss.backward()" in said[0]


@pytest.mark.parametrize("optimizers", [1, 2])
def test_loss_backward_before_every_step_says_nothing(optimizers: int) -> None:
    said, step = _train("loss", optimizers=optimizers)
    assert said == [] and step == 3
