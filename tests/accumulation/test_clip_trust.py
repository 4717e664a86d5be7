"""fp16 + clipping never applies an overflowed step (issue 11, point 3).

Clipping before the first ``opt.step()`` used to clamp still-scaled gradients, turning an inf
into a finite number, and the overflowed step was applied. The scoped loop must match torch's
recipe (``scaler.unscale_`` then clip) bit for bit, with the poisoned step skipped.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from accel_ctx import accumulate, mixed_precision

from .._spawn import spawn
from ..workers import clip_trust
from ..workers.common import MLP, make_data, params


@pytest.mark.parametrize("where", ["grad", "loss"])
@pytest.mark.parametrize(("routed", "name", "at"), clip_trust.CASES)
def test_fp16_clipping_skips_an_overflow_like_the_recipe(routed, name, at, where):
    result = clip_trust.compare(routed, name, at, where, dist=False)
    assert result["skipped"] == 1, result
    assert result["finite"], result
    assert result["same"], result
    assert result["scale"] == result["hand_scale"] == 2.0**15


def test_fp16_clipping_skips_an_overflow_on_two_ranks(tmp_path):
    per_rank = spawn(clip_trust.two_ranks, 2, tmp_path)
    for rank, results in enumerate(per_rank):
        for case, result in results.items():
            where = f"rank {rank}, case {case}"
            assert result["skipped"] == 1, (where, result)
            assert result["finite"], (where, result)
            assert result["same"], (where, result)
            assert result["scale"] == result["hand_scale"] == 2.0**15, (where, result)


def test_fabrics_clip_val_is_clip_grad_value_on_unscaled_grads_at_the_groups_end():
    """``fabric.clip_gradients(model, opt, clip_val=v)`` is ``scaler.unscale_(opt)`` then
    ``torch.nn.utils.clip_grad_value_(params, v)`` before the step (docs/migrate-fabric.md):
    torch's call inside fp16 + accumulate(2), made at every micro-step, gives the same weights."""
    torch.manual_seed(0)
    with mixed_precision("fp16"), accumulate(2):
        model = MLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        batches = []
        for x, y in DataLoader(make_data(), batch_size=8, shuffle=True):
            batches.append((x, y))
            F.cross_entropy(model(x), y).backward()
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)  # waits for the group's end
            opt.step()
            opt.zero_grad()
    torch.manual_seed(0)
    hand = MLP()
    hand_opt = torch.optim.SGD(hand.parameters(), lr=0.5, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    for i, (x, y) in enumerate(batches):
        with torch.autocast("cpu", dtype=torch.float16):
            out = hand(x)
        scaler.scale(F.cross_entropy(out.float(), y) / 2).backward()
        if i % 2 == 1:  # Fabric's clip_gradients(clip_val=0.01) at the boundary
            scaler.unscale_(hand_opt)
            torch.nn.utils.clip_grad_value_(hand.parameters(), 0.01)
            scaler.step(hand_opt)
            scaler.update()
            hand_opt.zero_grad()
    assert len(batches) % 2 == 0
    mine, theirs = params(model), params(hand)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
