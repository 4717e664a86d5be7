"""Checked by mypy (not run): the public signatures keep the types users rely on."""

from __future__ import annotations

from collections.abc import Callable

import torch
from typing_extensions import assert_type

from accel_ctx import (
    State,
    accumulate,
    autocast_forward,
    clip_grad_norm_,
    distributed,
    mixed_precision,
    no_sync,
    state,
)


def train_step(x: torch.Tensor, scale: float = 1.0) -> float:
    return float(x.sum()) * scale


same: Callable[[torch.Tensor, float], float] = distributed()(train_step)
assert_type(distributed()(train_step)(torch.ones(1), 2.0), float)
decorated = mixed_precision("bf16")(train_step)
assert_type(decorated(torch.ones(1)), float)
assert_type(accumulate(2)(train_step)(torch.ones(1), scale=2.0), float)
assert_type(no_sync()(train_step)(torch.ones(1)), float)
assert_type(autocast_forward(train_step)(torch.ones(1)), float)
assert_type(state(), State)
assert_type(state().rank, int)
assert_type(state().is_main_process, bool)
assert_type(clip_grad_norm_([torch.ones(1)], 1.0), torch.Tensor)

with distributed(timeout=30, find_unused_parameters=True) as scope:
    assert_type(scope, distributed)

# --- process control, collectives, launcher, checkpoints
from accel_ctx import (  # noqa: E402
    Resumed,
    gather,
    gather_for_metrics,
    launch,
    load_state,
    on_main_process,
    reduce,
    save_state,
)


@on_main_process
def report(epoch: int) -> str:
    return f"epoch {epoch}"


assert_type(report(1), str | None)
assert_type(gather(torch.ones(2)), torch.Tensor)
assert_type(reduce({"loss": torch.ones(1)}), dict[str, torch.Tensor])
assert_type(gather_for_metrics((torch.ones(2), torch.ones(2))), tuple[torch.Tensor, torch.Tensor])
assert_type(load_state("ckpt"), Resumed)
assert_type(launch(train_step, nprocs=2, args=(torch.ones(1),)), float)
save_state("ckpt", model=torch.nn.Linear(1, 1))
