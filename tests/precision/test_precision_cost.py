"""mixed_precision() costs what torch's AMP recipe costs: no extra output copy, no extra host sync.

Counted on the CPU, where no allocator statistics exist: every tensor the ops of a training step
produce is recorded by a TorchDispatchMode (its storage bytes, once per storage), and every call
that would wait for a GPU (``.item()``, ``.tolist()``, ``bool(t)``, ``.cpu()``...) by a
TorchFunctionMode, on the scope's loop and on the same loop written by hand.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from accel_ctx import distributed, mixed_precision, state

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
VOCAB, BATCH, WIDTH = 4096, 64, 32


class Bytes(TorchDispatchMode):
    """Bytes of new storage each op produces, and the fp32 tensors of the logits' shape."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.fp32_logits = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        inputs = {t.untyped_storage().data_ptr()
                  for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.total += t.untyped_storage().nbytes()  # new memory (not a view, not in place)
                if t.dtype == torch.float32 and t.shape == (BATCH, VOCAB):
                    self.fp32_logits += 1
        return out


_SYNCING = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__,
            torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__,
            torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.nonzero, torch.nonzero}


class Syncs(TorchFunctionMode):
    """Calls that would make the host wait for the device."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in _SYNCING:
            self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


class Head(nn.Module):
    """A language-model head shaped as nanoGPT's: returns (logits, loss) when given targets."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU())
        self.lm_head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        logits = self.lm_head(self.body(x))
        return (logits,) if y is None else (logits, F.cross_entropy(logits, y))


def _head() -> nn.Module:
    torch.manual_seed(0)
    return Head()


def _batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, VOCAB, (BATCH,), generator=g))
            for _ in range(n)]


OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
    "sgd-fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
}


def _recipe(policy: str, mode: TorchDispatchMode | TorchFunctionMode, optimizer: str = "adamw",
            clip: bool = False, schedule: bool = False) -> dict[str, torch.Tensor]:
    model = _head()
    opt = OPTIMIZERS[optimizer](model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    scaler = torch.amp.GradScaler("cpu", enabled=policy == "fp16")
    batches = _batches()
    with mode:
        for x, y in batches:
            with torch.autocast("cpu", dtype=DTYPES[policy]):
                loss = F.cross_entropy(model(x)[0], y) + model(x, y)[1]
            scaler.scale(loss).backward()
            if clip:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            if schedule:
                sched.step()
            opt.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _scoped(policy: str, mode: TorchDispatchMode | TorchFunctionMode, optimizer: str = "adamw",
            clip: bool = False, schedule: bool = False, **options: object
            ) -> dict[str, torch.Tensor]:
    with distributed(), mixed_precision(policy, **options):  # type: ignore[arg-type]
        model = _head()
        opt = OPTIMIZERS[optimizer](model.parameters())
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        batches = _batches()
        with mode:
            for x, y in batches:  # the loss outside the model, and inside it (nanoGPT)
                loss = F.cross_entropy(model(x)[0], y) + model(x, y)[1]
                loss.backward()
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                if schedule:
                    sched.step()
                opt.zero_grad()
                if state().is_main_process:  # a snapshot per step reads nothing from the device
                    pass
        return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("policy", ["bf16", "fp16"])
def test_a_training_step_allocates_what_the_recipe_allocates(policy):
    recipe, ours, old_rule = Bytes(), Bytes(), Bytes()
    expected = _recipe(policy, recipe)
    trained = _scoped(policy, ours)
    # the model runs twice per step: both forwards share the weights' casts, as in the recipe
    assert all(torch.equal(trained[k], expected[k]) for k in expected)
    _scoped(policy, old_rule, output_dtype=torch.float32)
    logits_fp32 = BATCH * VOCAB * 4
    assert ours.fp32_logits == recipe.fp32_logits  # autocast's own, for the loss
    assert ours.total <= recipe.total * 1.01, (ours.total, recipe.total)
    # the measurement sees a copy when one is made: casting the outputs (the rule before) costs
    # one fp32 copy of the logits the model returns with its loss, per step
    assert old_rule.total >= recipe.total + 3 * logits_fp32


@pytest.mark.parametrize("policy", ["bf16", "fp16"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("clip", [False, True], ids=["", "clipped"])
def test_no_host_sync_beyond_the_recipes(policy, optimizer, clip):
    recipe, ours = Syncs(), Syncs()
    expected = _recipe(policy, recipe, optimizer, clip)
    trained = _scoped(policy, ours, optimizer, clip)
    assert all(torch.equal(trained[k], expected[k]) for k in expected)
    # Unfused AdamW reads its step counts (.item() per parameter) and GradScaler the inf flag
    # once per fp16 step. A fused optimizer takes the scale and the flag on the device: neither
    # the recipe nor the scope waits for it, with or without clipping.
    assert sorted(ours.calls) == sorted(recipe.calls)
    if optimizer.endswith("fused"):
        assert ours.calls == []


@pytest.mark.parametrize("optimizer", ["adamw-fused", "sgd-fused"])
def test_a_scheduler_under_fp16_reads_the_fused_steps_skip_flag_once_per_step(optimizer):
    recipe, ours = Syncs(), Syncs()
    _recipe("fp16", recipe, optimizer, schedule=True)
    _scoped("fp16", ours, optimizer, schedule=True)
    # The schedule advances only with real steps: learning that costs the one read per step an
    # unfused GradScaler step makes; the recipe advances the schedule on skipped steps too.
    assert recipe.calls == []
    assert ours.calls == ["item"] * len(_batches())
