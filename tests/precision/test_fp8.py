"""mixed_precision("fp8"): torchao's float8 training for the Linear layers, bf16 for the rest.

Done when a GPT-shaped model trains under fp8 with its Linear layers converted, its loss within
LOSS_TOLERANCE (5 %) of the bf16 run's over 50 steps, on one process, on 2 ranks (DDP) and
sharded (FSDP2); checkpoints round-trip bit for bit (with torchao's low-bit optimizers too) and
load into a plain model. Without torchao, fp8 names the extra to install (tested by hiding it);
the tests that need torchao are skipped, saying why.
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from accel_ctx import distributed, mixed_precision, state
from accel_ctx.errors import ArgumentError, ConfigurationError

from .._spawn import spawn
from .._timeouts import scaled
from ..workers import fp8 as w

NO_TORCHAO = "mixed_precision('fp8') needs torchao: pip install 'accel-ctx[fp8]'"


@pytest.fixture
def torchao():
    return pytest.importorskip("torchao", reason=NO_TORCHAO)


def mean_tail(losses: list[float]) -> float:
    return sum(losses[-10:]) / 10


def assert_close_to_bf16(fp8: dict, bf16: dict) -> None:
    assert len(fp8["losses"]) == len(bf16["losses"]) == w.STEPS
    assert abs(mean_tail(fp8["losses"]) - mean_tail(bf16["losses"])) <= (
        w.LOSS_TOLERANCE * mean_tail(bf16["losses"])), (fp8["losses"], bf16["losses"])
    assert mean_tail(fp8["losses"]) < 0.5 * fp8["losses"][0]  # it learnt


def test_a_gpt_trains_in_fp8_like_bf16_on_one_process(torchao):
    bf16, fp8 = w.train("one", "bf16"), w.train("one", "fp8")
    assert bf16["layers"] == {"Linear"} and fp8["layers"] == {"Float8Linear"}
    assert fp8["lm_head"] == "Float8Linear"  # tied to the embedding: still one Parameter
    assert fp8["same_params"] and fp8["optimizer_follows"]  # made before the first forward
    assert fp8["keys"] == bf16["keys"]  # the user's state_dict keys, no new prefix
    assert_close_to_bf16(fp8, bf16)


def test_qualifying_linears_and_the_users_filter(torchao):
    from torchao.float8.float8_linear import Float8Linear

    seen: list[str] = []

    def keep_head_in_bf16(module: nn.Module, name: str) -> bool:
        seen.append(name)
        return name != "head"

    model = nn.Sequential()
    model.add_module("body", nn.Linear(32, 64))
    model.add_module("odd", nn.Linear(64, 40))  # 40 is no multiple of 16
    model.add_module("back", nn.Linear(40, 32))
    model.add_module("head", nn.Linear(32, 16))
    net = torch.compile(model, backend="eager")  # converted with the user's names
    with mixed_precision("fp8", fp8_filter=keep_head_in_bf16):
        assert state().mixed_precision == "fp8"
        out = net(torch.randn(4, 32))
    assert out.dtype == torch.bfloat16
    assert [type(m) is Float8Linear for m in model] == [True, False, False, False]
    assert seen == ["body", "head"]
    assert list(model.state_dict()) == [f"{n}.{p}" for n in ("body", "odd", "back", "head")
                                        for p in ("weight", "bias")]
    with pytest.raises(ConfigurationError, match="only mixed_precision\\('fp8'\\)"):
        mixed_precision("bf16", fp8_filter=keep_head_in_bf16)
    with pytest.raises(ConfigurationError, match="function \\(module, name\\)"):
        mixed_precision("fp8", fp8_filter="lm_head")
    with pytest.raises(ConfigurationError, match="Float8LinearConfig"):
        mixed_precision("fp8", fp8_config={"recipe": "rowwise"})


def test_a_model_with_nothing_to_convert_warns_once_and_a_loss_module_does_not(torchao):
    small = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with warnings.catch_warnings(record=True) as caught, mixed_precision("fp8"):
        warnings.simplefilter("always")
        for _ in range(2):
            loss = nn.functional.cross_entropy(small(torch.randn(3, 4)), torch.tensor([0, 1, 0]))
        nn.MSELoss()(torch.randn(2), torch.randn(2))  # a module with no Linear: no word
    messages = [str(c.message) for c in caught if "fp8" in str(c.message)]
    assert len(messages) == 1 and "0 is 4 -> 8" in messages[0] and "multiples of 16" in messages[0]
    assert loss.dtype == torch.float32


def test_fp8_under_torch_compile_trains_as_eager(torchao):
    def run(compiled: bool) -> list[float]:
        model, opt = w.model_and_optimizer()
        batches = torch.Generator().manual_seed(0)
        with mixed_precision("fp8"):
            if compiled:
                model.compile(backend="aot_eager")  # inductor: the same, minutes on a CPU
            losses = [w.step(model, opt, batches) for _ in range(3)]
        assert type(model.lm_head).__name__ == "Float8Linear"
        return losses

    assert run(compiled=True) == pytest.approx(run(compiled=False), rel=1e-3)


def test_checkpoints_round_trip_and_load_into_a_plain_model_on_one_process(torchao, tmp_path):
    resumed = w.resume("one", tmp_path / "ckpt", "adamw8bit")
    assert resumed["weights"] == [] and resumed["optimizer"] == []
    assert "codes" in resumed["low_bit"]  # the 8-bit state itself, bit for bit
    model, opt = w.model_and_optimizer("adamw4bit")
    batches = torch.Generator().manual_seed(0)
    with torch.compiler.set_stance("force_eager"):  # torchao compiles its step: minutes
        with mixed_precision("fp16", init_scale=2.0**40):
            w.step(model, opt, batches)  # the gradients overflow: the step is skipped
            assert state().skipped_steps == 1 and not opt.state  # the optimizer untouched
        with mixed_precision("fp16"):
            losses = [w.step(model, opt, batches) for _ in range(4)]
    assert losses[-1] < losses[0] and len(opt.state) == len(list(model.parameters()))
    plain = w.saved_model_loads_plain("one", tmp_path / "model.pt")
    assert plain == {"missing": [], "unexpected": [], "differ": [], "types": {"Tensor"}}


def test_the_launchers_fp8_converts_under_distributed(torchao, monkeypatch):
    monkeypatch.setenv("ACCEL_CTX_MIXED_PRECISION", "fp8")
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    with distributed():
        assert state().mixed_precision == "fp8"
        assert model(torch.randn(2, 16)).dtype == torch.bfloat16
    assert type(model[0]).__name__ == "Float8Linear"


def test_without_torchao_fp8_names_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # as if it were not installed
    with pytest.raises(ConfigurationError, match='pip install "accel-ctx\\[fp8\\]"'):
        mixed_precision("fp8")
    with mixed_precision("bf16"):  # the other policies need no torchao
        assert state().mixed_precision == "bf16"
    monkeypatch.setenv("ACCEL_CTX_MIXED_PRECISION", "fp8")
    with pytest.raises(ConfigurationError, match=r"--mixed-precision fp8.*accel-ctx\[fp8\]"), \
            distributed():
        pass


def test_importing_accel_ctx_and_opening_fp8_import_no_torchao(torchao):
    code = ("import sys, accel_ctx\n"
            "from accel_ctx import mixed_precision\n"
            "assert 'torchao' not in sys.modules\n"
            "with mixed_precision('fp8'):\n"
            "    pass\n"
            "assert 'torchao' not in sys.modules, 'imported before the first conversion'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=scaled(120))
    assert result.returncode == 0, result.stderr


def test_the_first_conversion_prints_nothing_of_torchaos_import(torchao):
    code = ("import torch\n"
            "from accel_ctx import mixed_precision\n"
            "torch.manual_seed(0)\n"
            "with mixed_precision('fp8'):\n"
            "    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU())\n"
            "    model(torch.randn(4, 32)).float().sum().backward()\n"
            "import logging\n"  # torchao's logger is left as it was: its later lines pass
            "logging.getLogger('torchao').warning('Failed to load later')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=scaled(120))
    assert result.returncode == 0, result.stderr
    assert "Failed to load" in result.stderr and "later" in result.stderr
    if not torch.cuda.is_available():  # a CUDA host keeps its failed CUDA libraries said
        assert result.stderr.count("Failed to load") == 1, result.stderr
    assert "Enum subclass" not in result.stderr, result.stderr


def test_a_filter_that_cannot_take_module_and_name_is_refused_where_it_is_given(torchao):
    with pytest.raises(TypeError, match=r"fp8_filter\(module, name\).*\(name\)"):
        mixed_precision("fp8", fp8_filter=lambda name: name != "head")
    with pytest.raises(ArgumentError, match="module_filter_fn"):
        mixed_precision("fp8", fp8_filter=lambda module, name, extra: True)
    mixed_precision("fp8", fp8_filter=lambda *args: True)  # these take two arguments
    mixed_precision("fp8", fp8_filter=lambda module, fqn, depth=0: True)


def test_two_ranks_ddp_and_sharded_checkpoints_and_low_bit_optimizers(torchao, tmp_path):
    results = spawn(w.two_ranks, 2, tmp_path, str(tmp_path), timeout=300)
    for out in results:
        bf16 = out["ddp", "bf16"]
        for kind in ("ddp", "fsdp"):
            fp8 = out[kind, "fp8"]
            assert fp8["world"] == 2 and fp8["layers"] == {"Float8Linear"}, kind
            assert fp8["keys"] == bf16["keys"] and fp8["optimizer_follows"], kind
            assert_close_to_bf16(fp8, bf16)
        assert out["ddp", "fp8"]["same_params"]
        # sharded(): the weights are gathered in float8 (torchao's float8 all-gather)
        assert out["fsdp", "fp8"]["weight"] == "WeightWithDynamicFloat8CastTensor"
        for kind, optimizer in (("fsdp", "adamw8bit"), ("ddp", "adamw4bit")):
            resumed = out["resume", kind]
            assert resumed["weights"] == [] and resumed["optimizer"] == [], (kind, resumed)
            assert "codes" in resumed["low_bit"], (kind, optimizer)
        assert "AdamW4bit" in out["low_bit_refused"] and "Float8LinearConfig()" in (
            out["low_bit_refused"])
        assert out["plain"] == {"missing": [], "unexpected": [], "differ": [],
                                "types": {"Tensor"}}
        assert "tp=2" in out["tp"] and "mixed_precision('bf16')" in out["tp"]
        assert "already sharded" in out["sharded_first"] and "conversion must come first" in (
            out["sharded_first"])
