"""sharded(engine="deepspeed"): DeepSpeed's ZeRO under the plain loop, on 2 real ranks (gloo).

The same loop (seed before the scopes, model and AdamW built inside, shuffled loader, dropout,
an LR scheduler, the loop's own clip or none, an evaluation at the end) under distributed() and
under ZeRO-1/2/3, CPU offload, an HF-style config of "auto" values, accumulate(2) and bf16
autocast; accumulate(2) beside DeepSpeed's own accumulation written by hand; the misuses.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from .._spawn import spawn
from ..workers import zero as w

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="DeepSpeed is not installed (accel-ctx[deepspeed])")


def _equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), what
    for key, value in want.items():
        assert torch.equal(got[key], value), f"{what}: {key} differs by " \
            f"{(got[key] - value).abs().max().item():.3g}"


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str,
           tol: float) -> None:
    assert sorted(got) == sorted(want), what
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=tol, atol=tol,
                                   msg=lambda m, key=key: f"{what}: {key}: {m}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero")
    return spawn(w.equivalence, 2, tmp, str(tmp), timeout=600)


def test_zero_1_and_2_train_bit_for_bit_as_distributed(runs):
    for rank, result in enumerate(runs):
        for stage in ("zero1", "zero2"):
            _equal(result[stage]["weights"], result["ddp"]["weights"], f"rank {rank}: {stage}")
            assert result[stage]["losses"] == result["ddp"]["losses"]
            assert result[stage]["eval"] == result["ddp"]["eval"]
            assert result[stage]["lr"] == result["ddp"]["lr"]  # the loop's scheduler stepped


def test_zero_3_trains_as_distributed_and_save_model_gathers_its_weights(runs):
    result = runs[0]
    _close(result["zero3"]["saved"], result["ddp_saved"]["saved"], "ZeRO-3's save_model", 1e-5)
    assert result["zero3"]["losses"] == pytest.approx(result["ddp"]["losses"], abs=1e-5)
    # a state dict of partitions would be empty tensors: every weight has its full shape
    assert all(v.numel() > 0 for v in result["zero3"]["saved"].values())


def test_a_model_touched_before_its_first_forward_trains_the_same(runs):
    # counted, loaded from its own state dict, moved and set to train() before the first
    # forward (the engine is built at that forward, from what the touches left)
    for rank, result in enumerate(runs):
        _equal(result["zero2_touched"]["weights"], result["ddp"]["weights"], f"rank {rank}")
        _close(result["zero3_touched"]["saved"], result["ddp_saved"]["saved"],
               f"rank {rank}: ZeRO-3", 1e-5)


def test_the_loops_clip_is_the_clipping_and_no_clip_means_none(runs):
    for rank, result in enumerate(runs):
        _close(result["zero1_clip"]["weights"], result["ddp_clip"]["weights"],
               f"rank {rank}: ZeRO-1 clip", 1e-6)
        # ZeRO divides by the norm over its partitions where torch multiplies by its inverse
        _close(result["zero2_clip"]["weights"], result["ddp_clip"]["weights"],
               f"rank {rank}: clip", 1e-6)
        assert result["zero2_clip"]["norms"] == pytest.approx(result["ddp_clip"]["norms"],
                                                              rel=1e-5)
        assert max(result["ddp_clip"]["norms"]) > 0.5  # the clip did clip
        # the same loop without a clip was not clipped (the "no clip" run above is bit-exact)
        assert not torch.equal(result["zero2_clip"]["weights"]["0.weight"],
                               result["zero2"]["weights"]["0.weight"])


def test_offload_and_an_hf_config_of_auto_values(runs):
    for rank, result in enumerate(runs):
        _close(result["zero2_offload"]["weights"], result["ddp"]["weights"],
               f"rank {rank}: offload='cpu'", 1e-5)
        _equal(result["zero2_hf"]["weights"], result["ddp"]["weights"], f"rank {rank}: config")


def test_accumulate_and_bf16(runs):
    for rank, result in enumerate(runs):
        _equal(result["zero1_acc"]["weights"], result["ddp_acc"]["weights"],
               f"rank {rank}: accumulate(2)")
        _close(result["zero2_offload_acc"]["weights"], result["ddp_acc"]["weights"],
               f"rank {rank}: accumulate(2) with offload", 1e-5)
        _close(result["zero2_bf16"]["weights"], result["ddp_bf16"]["weights"],
               f"rank {rank}: bf16", 1e-2)


def test_accumulate_equals_deepspeeds_own_accumulation_written_by_hand(tmp_path):
    # DeepSpeed's own accumulation by hand: gradient_accumulation_steps=2, engine.backward and
    # engine.step() at every micro-batch, gradient_clipping 0 (its default clips at 1.0)
    for rank, result in enumerate(spawn(w.hand_accumulation, 2, tmp_path, timeout=300)):
        for stage, run in result.items():
            assert run["ours"]["losses"] == run["hand"]["losses"], f"rank {rank}: ZeRO-{stage}"
            if stage != 3:  # ZeRO-3's state_dict() holds partitions; its losses say enough
                _equal(run["ours"]["weights"], run["hand"]["weights"], f"rank {rank}: {stage}")


def test_misuse_is_refused_naming_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("ZERO_TMP", str(tmp_path / "ckpt"))
    said = spawn(w.refusals, 2, tmp_path, timeout=300)[0]
    assert "make the optimizer" in said["no_optimizer"]
    assert "2 optimizers" in said["two_optimizers"]
    assert "gradient_accumulation_steps=4" in said["contradicting_accumulation"]
    assert "accumulate(2)" in said["contradicting_accumulation"]
    assert "gradient_clipping=1.0" in said["config_clips_loop_does_not"]
    assert "no clip_grad_norm_" in said["config_clips_loop_does_not"]
    assert "clip_grad_norm_" in said["value_clip"]
    assert "fp16's loss scaling is not supported yet" in said["fp16"]
    assert "torch.bfloat16 weights" in said["true_half"]
    assert "rank-only code" in said["rank_only_zero3"]
    assert "tp= is not supported with it yet" in said["tensor_parallel"]
    assert "2-norm only" in said["norm_type"]


def test_save_state_a_restart_and_load_state_end_as_the_run_never_stopped(tmp_path):
    root = str(tmp_path / "checkpoints")
    whole, first, second = (spawn(w.checkpoint_phase, 2, tmp_path / phase, root, phase,
                                  timeout=300) for phase in ("whole", "first", "second"))
    for rank in range(2):
        for run, straight in whole[rank].items():
            resumed = second[rank][run]
            assert first[rank][run]["losses"] + resumed["losses"] == straight["losses"], run
            _equal(resumed["weights"], straight["weights"], f"rank {rank}: ZeRO {run}")
        # what ZeRO-3 saved loads under DDP: the weights and the optimizer's place as saved
        into_ddp = second[rank]["zero3_into_ddp"]
        _equal(into_ddp["weights"], first[rank]["3-None"]["weights"], f"rank {rank}: into DDP")
        assert set(into_ddp["steps"]) == {float(len(first[rank]["3-None"]["losses"]))}


def test_resumable_resumes_a_deepspeed_run_from_its_last_checkpoint(tmp_path):
    whole, first, second = (
        spawn(w.resumable_phase, 2, tmp_path / phase,
              str(tmp_path / ("straight" if phase == "whole" else "stopped")), phase,
              timeout=300) for phase in ("whole", "first", "second"))
    for rank in range(2):
        for stage, straight in whole[rank].items():
            assert first[rank][stage]["losses"] == straight["losses"][:10]
            # saved after step 8 (every_steps=4): the second start runs steps 9.. as the
            # whole run did
            assert second[rank][stage]["losses"] == straight["losses"][8:], stage
            assert second[rank][stage]["step"] == straight["step"] == 16
            _equal(second[rank][stage]["weights"], straight["weights"], f"ZeRO-{stage}")


@pytest.mark.parametrize("stage", [2, 3])
def test_a_rank_stalled_under_deepspeed_is_named_within_the_timeout(tmp_path, stage):
    from .._timeouts import scaled
    from ..workers.blame_trust import STALL_TIMEOUT

    for rank, (kind, message, culprit, seconds) in enumerate(
            spawn(w.stalled_under_deepspeed, 2, tmp_path, str(tmp_path), stage, timeout=300)):
        assert kind == "DistributedError", (rank, kind, message)
        assert culprit == 1, message
        assert "rank 1 stopped answering at step 3, in forward" in message, message
        if rank == 0:  # DeepSpeed's collectives wait distributed(timeout=), not 30 minutes
            assert seconds < scaled(STALL_TIMEOUT + 45.0), seconds
