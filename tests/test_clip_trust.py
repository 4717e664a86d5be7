"""fp16 + clipping never applies an overflowed step (issue 11, point 3).

Clipping before the first ``opt.step()`` used to clamp still-scaled gradients, turning an inf
into a finite number, and the overflowed step was applied. The scoped loop must match torch's
recipe (``scaler.unscale_`` then clip) bit for bit, with the poisoned step skipped.
"""

from __future__ import annotations

import pytest

from ._spawn import spawn
from .workers import clip_trust


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
