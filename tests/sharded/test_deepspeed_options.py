"""sharded(engine="deepspeed")'s options and configs: each mistake refused when the scope is
made, naming the cause and the fix; the "auto" values of an HF-style config filled from the loop."""

from __future__ import annotations

import importlib.util
import json

import pytest

from accel_ctx import sharded
from accel_ctx._engines import zero_config
from accel_ctx.errors import ConfigurationError

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="DeepSpeed is not installed (accel-ctx[deepspeed])")


@needs_deepspeed
@pytest.mark.parametrize(("kwargs", "said"), [
    ({"engine": "megatron"}, "give one of 'fsdp2', 'deepspeed'"),
    ({"engine": "deepspeed", "stage": 4}, "stage 1"),
    ({"engine": "deepspeed", "stage": True}, "stage 1"),
    ({"engine": "deepspeed", "offload": "nvme"}, "NVMe offload is not supported yet"),
    ({"engine": "deepspeed", "blocks": [object]}, "blocks is one of FSDP2's options"),
    ({"engine": "deepspeed", "reshard_after_forward": False}, "FSDP2's options"),
    ({"engine": "deepspeed", "cpu_offload": True}, "FSDP2's options"),
    ({"stage": 2}, "stage is one of DeepSpeed's"),
    ({"offload": "cpu"}, "offload is one of DeepSpeed's"),
    ({"engine": "deepspeed", "config": 3}, "give a dict of DeepSpeed settings"),
    ({"engine": "deepspeed", "config": {"optimizer": {"type": "Adam"}}},
     "replace the loop's own optimizer"),
    ({"engine": "deepspeed", "config": {"scheduler": {"type": "WarmupLR"}}},
     "the loop's own LR scheduler"),
    ({"engine": "deepspeed", "config": {"fp16": {"enabled": True}}}, "mixed_precision"),
    ({"engine": "deepspeed", "config": {"bf16": {"enabled": True}}}, "mixed_precision"),
    ({"engine": "deepspeed", "stage": 3, "config": {"zero_optimization": {"stage": 1}}},
     "disagree"),
    ({"engine": "deepspeed", "config": {"zero_optimization": {
        "offload_optimizer": {"device": "cpu"}}}}, "disagree"),
    ({"engine": "deepspeed", "config": {"zero_optimization": {
        "offload_param": {"device": "cpu"}}}}, "offload_param"),
    ({"engine": "deepspeed", "config": {"zero_optimization": 3}}, "must be an object"),
])
def test_a_mistake_is_refused_when_the_scope_is_made(kwargs, said):
    with pytest.raises(ConfigurationError) as caught:
        sharded(**kwargs)
    assert said in str(caught.value)


def test_without_deepspeed_the_error_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "deepspeed" else real(name, *a))
    with pytest.raises(ConfigurationError, match=r"accel-ctx\[deepspeed\]"):
        sharded(engine="deepspeed")


@needs_deepspeed
def test_a_config_file_that_is_not_json_is_refused(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text("{stage: 2")
    with pytest.raises(ConfigurationError, match="cannot read it as a DeepSpeed JSON config"):
        sharded(engine="deepspeed", config=str(path))
    path.write_text("[1, 2]")
    with pytest.raises(ConfigurationError, match="holds a list"):
        sharded(engine="deepspeed", config=path)


@needs_deepspeed
def test_the_stage_comes_from_the_config_when_not_given(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    assert sharded(engine="deepspeed", config=path).plan.stage == 3
    assert sharded(engine="deepspeed").plan.stage == 2


HF_AUTO = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
           "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
           "zero_optimization": {"stage": "auto", "overlap_comm": "auto",
                                 "reduce_bucket_size": "auto"},
           "bf16": {"enabled": "auto"}, "steps_per_print": 100}


def test_auto_values_are_filled_from_the_loop_and_the_loop_keeps_its_parts():
    out = zero_config.complete(HF_AUTO, stage=2, offload="cpu", micro_batch=8, world_size=4,
                               accumulation=1)
    assert out["train_micro_batch_size_per_gpu"] == 8
    assert out["train_batch_size"] == 32
    assert out["gradient_accumulation_steps"] == 1
    assert out["gradient_clipping"] == 0.0  # the loop's clip_grad_norm_, not DeepSpeed's
    assert out["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    assert "bf16" not in out and out["steps_per_print"] == 100
    assert out["zero_force_ds_cpu_optimizer"] is False  # the loop's optimizer under offload
    assert HF_AUTO["zero_optimization"]["stage"] == "auto"  # the user's dict untouched
    acc = zero_config.complete(HF_AUTO, stage=1, offload=None, micro_batch=8, world_size=2,
                               accumulation=4)
    assert acc["managed_gradient_accumulation"] is False  # accumulate(4)'s boundaries


@pytest.mark.parametrize(("config", "said"), [
    ({"gradient_accumulation_steps": 8}, "accumulate(4) disagree"),
    ({"train_batch_size": 100}, "8 per micro-batch x accumulate(4) x 2 processes = 64"),
    ({"train_micro_batch_size_per_gpu": 16}, "the loop's batches of 8"),
    ({"wall_clock_breakdown": "auto"}, "'wall_clock_breakdown' is \"auto\""),
])
def test_a_value_that_contradicts_the_loop_is_refused_naming_both(config, said):
    with pytest.raises(ConfigurationError) as caught:
        zero_config.complete(config, stage=2, offload=None, micro_batch=8, world_size=2,
                             accumulation=4)
    assert said in str(caught.value)


def test_accumulation_leaves_the_boundaries_to_the_loop_also_under_offload():
    done = zero_config.complete({}, stage=2, offload="cpu", micro_batch=8, world_size=2,
                                accumulation=2)
    assert done["managed_gradient_accumulation"] is False
    assert done["gradient_accumulation_steps"] == 1
    assert done["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}


def test_accumulation_with_zero1_and_overlapped_reduction_is_refused_naming_the_fix():
    config = {"zero_optimization": {"overlap_comm": True}}
    with pytest.raises(ConfigurationError, match="Set overlap_comm to false"):
        zero_config.complete(config, stage=1, offload=None, micro_batch=8, world_size=2,
                             accumulation=2)
    # without accumulation DeepSpeed's own boundaries hold: its setting is passed on
    done = zero_config.complete(config, stage=1, offload=None, micro_batch=8, world_size=2,
                                accumulation=1)
    assert done["zero_optimization"]["overlap_comm"] is True


@pytest.mark.parametrize(("value", "clip"), [("auto", None), (0, None), (1.0, 1.0)])
def test_the_configs_clipping_is_checked_against_the_loop(value, clip):
    assert zero_config.clipping({"gradient_clipping": value}) == clip
    with pytest.raises(ConfigurationError, match="give a number >= 0"):
        zero_config.clipping({"gradient_clipping": -1})
