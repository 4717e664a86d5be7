"""End to end: nanoGPT's training loop, its DDP/AMP touch points removed, inside the scopes."""

from __future__ import annotations

import pytest
import torch

from .._spawn import spawn
from ..workers import nanogpt


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return spawn(nanogpt.run_both, 2, tmp_path_factory.mktemp("gpt"), timeout=240)


def test_matches_nanogpts_hand_written_ddp_amp_loop(two_ranks):
    for rank in two_ranks:
        scoped, hand = rank["scoped"], rank["hand"]
        for k in hand["params"]:
            torch.testing.assert_close(scoped["params"][k], hand["params"][k], rtol=1e-5, atol=1e-6, msg=k)
        assert scoped["step"] == nanogpt.MAX_ITERS
        # the logits autocast made, as nanoGPT's own loop gets them: no fp32 copy of them
        assert scoped["logits_dtype"] == torch.bfloat16


def test_ranks_agree_and_the_model_learns(two_ranks):
    a, b = (rank["scoped"] for rank in two_ranks)
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k])
    assert a["losses"][-1] < a["losses"][0]
