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

# --- cross-rank decisions, batch-size search, progress and metrics (issue 14)
from collections.abc import Iterator  # noqa: E402

from accel_ctx import (  # noqa: E402
    all_ranks,
    any_rank,
    find_executable_batch_size,
    log_metrics,
    progress,
    synchronize_rng_states,
)

assert_type(any_rank(torch.tensor(float("nan")).isnan()), bool)
assert_type(all_ranks(True), bool)
synchronize_rng_states(["python", "torch"], [torch.Generator()], src=0)


@find_executable_batch_size(starting_batch_size=64)
def fit(batch_size: int, epochs: int, *, lr: float = 0.1) -> float:
    return batch_size * epochs * lr


assert_type(fit(3, lr=0.5), float)


def largest(batch_size: int) -> int:
    return batch_size


assert_type(find_executable_batch_size(largest)(), int)
assert_type(progress([1, 2, 3], desc="epoch 0"), Iterator[int])
log_metrics({"loss": 0.5, "lr": torch.tensor(0.1)}, step=3, directory="runs")
assert_type(launch(train_step, 2, (torch.ones(1),), max_restarts=1), float)
from accel_ctx import PowerSGD  # noqa: E402

with distributed(comm_hook="fp16"), distributed(comm_hook=PowerSGD(rank=2, batched=True)):
    pass
