"""sharded()'s options, precision and the mistakes it names (2 real ranks, gloo on CPU)."""

from __future__ import annotations

import pytest
import torch

from .._spawn import spawn
from ..workers import sharded as w

BATCH = 4


@pytest.fixture(scope="module")
def trust(tmp_path_factory):
    return spawn(w.options_and_misuse, 2, tmp_path_factory.mktemp("sharded-trust"), BATCH,
                 timeout=300)


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), what
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=f"{what}: {key}")


def test_blocks_given_by_class_or_predicate_and_hsdp_train_alike(trust):
    reference = w.train("plain", BATCH * 2, epochs=1, momentum=0.0)["weights"]
    for result in trust:
        for name in ("blocks_class", "blocks_fn", "hsdp", "keep_gathered"):
            _close(result[name]["weights"], reference, name)
        assert result["blocks_class"]["units"] == ["", "h.0", "h.1", "h.2"]
        assert result["blocks_fn"]["units"] == ["", "h.0.ln1", "h.0.ln2", "h.1.ln1", "h.1.ln2",
                                                "h.2.ln1", "h.2.ln2", "ln_f"]
        assert result["hsdp"]["mesh"] == [2, 1]  # replicated across 2, sharded over 1
        assert result["blocks_class"]["mesh"] == [2]


def test_no_sync_defers_the_reduce_scatter_to_the_next_backward(trust):
    reference = w.train("plain", BATCH * 2 * 2, epochs=1, momentum=0.0)["weights"]
    for result in trust:
        _close(result["no_sync"], reference, "no_sync pairs vs one process with both batches")


def test_mistakes_are_named_with_their_fix(trust):
    rank_only = trust[0]["rank_only"]  # rank 1 does not run on_main_process code
    assert "rank-only code" in rank_only and "every rank" in rank_only
    assert trust[1]["rank_only"] is None
    assert "rank-only code" in trust[0]["after_sharded_scope"]  # still sharded in the job
    assert trust[1]["after_sharded_scope_all"] == (4, 8, 32)
    for result in trust:
        assert "ConfigurationError" in result["ddp_then_sharded"]
        assert "Open sharded() before" in result["ddp_then_sharded"]
        assert "reset_parameters()" in result["meta_without_reset"]
        assert "Raw (scale)" in result["meta_without_reset"]
        assert "cpu_offload" in result["cpu_offload_on_cpu"]
        assert "blocks=" in result["bad_blocks"]
        assert "shard_size=0" in result["bad_shard_size"]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_gathers_in_low_precision_and_keeps_fp32_masters(tmp_path, precision):
    sharded = spawn(w.precision_run, 2, tmp_path, "sharded", precision, BATCH, timeout=180)
    ddp = spawn(w.precision_run, 2, tmp_path, "ddp", precision, BATCH, timeout=180)
    dtype = "torch.bfloat16" if precision == "bf16" else "torch.float16"
    for got, want in zip(sharded, ddp, strict=True):
        assert got["compute"] == [dtype]  # FSDP2's MixedPrecisionPolicy gathered it so
        assert got["master"] == ["torch.float32"]
        assert got["logits"] == want["logits"] == dtype  # the same output rule (the recipe's)
        assert got["skipped"] == want["skipped"]
        assert got["scale"] == want["scale"]
        # the same training within the precision's rounding
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]),
                                   rtol=0.05, atol=0.05)
    if precision == "fp16":
        assert sharded[0]["skipped"] > 0  # the loss scale started too high: steps skipped alike
