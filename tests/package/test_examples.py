"""Every example runs: a few steps each, as a user would start it (the main demo: test_demo)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
from pathlib import Path

import pytest

from .. import _launcher, _zygote
from .._timeouts import scaled

ROOT = Path(__file__).resolve().parents[2]
# Every warning shown, once per line (DeprecationWarnings too, which Python hides outside
# __main__), in every process the example starts; a correct example shows none (issue 41).
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "default"}
_WARNING = re.compile(r"^(.+?):(\d+): (\w*Warning): (.*)$", re.MULTILINE)
# The warnings an example may show, each with why it is not a fault of the example or of ours.
ALLOWED = (
    # accel_ctx's own notice where safetensors is not installed (the compat tier's
    # environments): the weights are written with torch.save instead, and it says where
    r"save_model: the safetensors package is not installed",
)


def unexpected_warnings(stderr: str) -> list[str]:
    """The warnings ``stderr`` shows that ALLOWED does not list."""
    return [m[0] for m in _WARNING.finditer(stderr)
            if not any(re.match(allowed, m[4]) for allowed in ALLOWED)]


def _forked_env() -> dict[str, str]:
    """ENV for a process forked from tests/_zygote.py's server (which imported torch once):
    every example but the README's quick start (test_demo: a real interpreter, as users
    start it). A launcher's workers and replica groups fork too."""
    return {**ENV, "PYTHONPATH": str(ROOT), "PYTHON_EXEC": _zygote.interpreter(),
            _zygote.FORK_REPLICA_WORKERS: "1"}


def _run(*args: str, cwd: Path) -> str:
    env = _forked_env()
    out = subprocess.run([env["PYTHON_EXEC"], "-u", *args], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=scaled(180))
    assert out.returncode == 0, out.stderr[-3000:]
    assert not unexpected_warnings(out.stderr), out.stderr[-3000:]
    return out.stdout


def _python(example: str, *args: str, cwd: Path) -> str:
    return _run(str(ROOT / "examples" / example), *args, cwd=cwd)



def test_basic_net_is_the_seed_tutorials_loop_with_one_line(tmp_path):
    assert "done: 3 steps" in _python("basic_net.py", "--steps", "3", cwd=tmp_path)
    assert (ROOT / "examples" / "basic_net.py").read_text().count("    with distributed():") == 1


def test_gan_trains_two_models_and_draws_the_ring_on_two_processes_as_on_one(tmp_path):
    # Trained for a number of steps, not epochs: on 2 processes an epoch has half the steps
    # (as under torchrun + DDP), and 3 epochs left the ring at radius 0.37 instead of 0.9.
    out = _run(_launcher.ACCEL_CTX, "launch", "-n", "2", str(ROOT / "examples" / "gan.py"),
               "--precision", "bf16", cwd=tmp_path)
    assert "done: 300 steps" in out, out
    radius = float(re.findall(r"mean radius of generated points (\d+\.\d+)", out)[-1])
    assert 0.8 < radius < 1.25, out  # one process: 1.13


def test_nanogpt_stops_and_resumes_from_its_checkpoint(tmp_path):
    first = _python("nanogpt.py", "--out", "run", "--steps", "4", cwd=tmp_path)
    assert "done: step 4" in first
    again = _python("nanogpt.py", "--out", "run", "--steps", "6", cwd=tmp_path)
    assert "resumed from run at step 4" in again and "done: step 6" in again
    assert any((tmp_path / "run").glob("model.*"))  # save_model's plain weights


def test_distributed_evaluation_counts_every_sample_once(tmp_path):
    out = _run(_launcher.ACCEL_CTX, "launch", "-n", "3", str(ROOT / "examples" / "evaluate.py"),
               cwd=tmp_path)
    assert "3 process(es) scored 1000 samples: accuracy 1.000" in out


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is not installed (pip install transformers)")
def test_hugging_face_model_fine_tunes_from_a_config(tmp_path):
    out = _python("hf_finetune.py", "--steps", "3", cwd=tmp_path)
    assert "done: 3 steps, GPT2LMHeadModel, save_pretrained: True" in out


@pytest.fixture(scope="module")
def resumable_runs(tmp_path_factory):
    """resumable_train.py stopped by a signal at step 5, started again, started a third time
    after it finished; and a run never stopped: one set of runs for the two tests below."""
    tmp_path = tmp_path_factory.mktemp("resumable")
    stopped = _zygote.run_script(str(ROOT / "examples" / "resumable_train.py"), "--out", "run",
                                 "--stop-at-step", "5", cwd=tmp_path, env=_forked_env(),
                                 timeout=scaled(180))
    again = _python("resumable_train.py", "--out", "run", cwd=tmp_path)
    finished = _python("resumable_train.py", "--out", "run", cwd=tmp_path)
    whole = _python("resumable_train.py", "--out", "whole", cwd=tmp_path)
    return {"stopped": stopped, "again": again, "finished": finished, "whole": whole}


CHECKSUM = re.compile(r"weights checksum (\S+)")


def test_resumable_run_stopped_by_a_signal_carries_on_from_its_step(resumable_runs):
    stopped, again = resumable_runs["stopped"], resumable_runs["again"]
    assert stopped.returncode == 143, stopped.stderr[-3000:]  # 128 + SIGTERM: saved, then out
    assert not unexpected_warnings(stopped.stderr), stopped.stderr[-3000:]
    assert "resumed from run at step 5" in again and "done: step 24" in again, again
    finished = resumable_runs["finished"]
    assert "done: step 24" in finished and CHECKSUM.findall(finished) == CHECKSUM.findall(again)


def test_resumable_run_stopped_and_resumed_ends_as_one_never_stopped(resumable_runs):
    resumed, whole = resumable_runs["again"], resumable_runs["whole"]
    assert "resumed" not in whole and "done: step 24" in whole, whole
    assert CHECKSUM.findall(resumed) and CHECKSUM.findall(resumed) == CHECKSUM.findall(whole)


def test_tensor_parallel_splits_the_mlp_over_two_ranks_and_counts_each_sample_once(tmp_path):
    out = _run(_launcher.ACCEL_CTX, "launch", "-n", "2",
               str(ROOT / "examples" / "tensor_parallel.py"),
               "--epochs", "1", cwd=tmp_path)
    for rank in (0, 1):
        assert (f"rank {rank}: tp_rank {rank}/2, dp_rank 0/1, "
                "blocks.0.up.weight (128, 32) holds (64, 32) here") in out, out
    accuracy = float(re.findall(r"tp=2, dp=1\) scored 512 samples: accuracy (\d\.\d+)", out)[0])
    assert accuracy > 0.7, out


def test_precision_trains_in_bf16_true_and_fp8(tmp_path):
    out = _python("precision.py", "--epochs", "1", cwd=tmp_path)
    assert "bf16-true: loss" in out and "parameters bfloat16, layers Linear" in out, out
    if importlib.util.find_spec("torchao") is None:
        assert "fp8: skipped: torchao is not installed" in out, out
    else:
        assert "parameters float32, layers Float8Linear/Linear" in out, out


def _launch(example: str, *args: str, cwd: Path) -> str:
    return _run(_launcher.ACCEL_CTX, "launch", *args[:args.index("--")],
                str(ROOT / "examples" / example),
                *args[args.index("--") + 1:], cwd=cwd)


def test_compiled_model_trains_inside_the_scopes_as_one_graph(tmp_path):
    out = _launch("compiled.py", "-n", "2", "--", "--backend", "aot_eager", "--epochs", "1",
                  cwd=tmp_path)
    # one line for the job, not one per process; each process compiled one graph
    assert out.count("done: Net ['up.weight', 'up.bias'], 1 graph(s) compiled") == 1, out


def test_local_sgd_ranks_agree_only_at_each_meeting(tmp_path):
    out = _launch("local_sgd.py", "-n", "2", "--", "--epochs", "1", cwd=tmp_path)
    assert out.count("done: local SGD on 2 process(es), 16 steps, every 4: the ranks' weights "
                     "agreed after steps [4, 8, 12, 16]") == 1, out


@pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                    reason="torchft is not installed (pip install 'torchft>=0.2')")
def test_replica_groups_train_in_step_with_equal_weights(tmp_path):
    out = _launch("replica_groups.py", "-n", "1", "--replica-groups", "2", "--",
                  "--steps", "4", cwd=tmp_path)
    lines = sorted(re.findall(r"group (\d): done at step 4 with 2 group\(s\), loss \S+, "
                              r"weights checksum (-?\d+\.\d+)", out))
    assert [g for g, _ in lines] == ["0", "1"], out  # one line per group, from its rank 0
    assert lines[0][1] == lines[1][1], out  # the groups' weights are the same
