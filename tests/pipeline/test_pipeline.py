"""Pipeline parallelism (issue 57): ``distributed(pp=N)`` cuts the model into stages and runs
GPipe behind the plain loop on real gloo ranks; every loss, the evaluation and the final weights
equal one process that cuts each batch into the same micro-batches, clipping included; a stage's
checkpoint has the whole model's names; each loop shape a pipeline cannot run is refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from accel_ctx import distributed
from accel_ctx._engines.pipeline_cut import Mailbox, cut
from accel_ctx.errors import ConfigurationError

from .._spawn import spawn
from .._timeouts import child_env, scaled
from ..workers import pipeline as w

ROOT = Path(__file__).resolve().parents[2]
ACCEL_CTX = str(Path(sys.executable).with_name("accel-ctx"))


def _close(got, want, what, tol=1e-6):
    assert len(got["losses"]) == len(want["losses"]), what
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]),
                               rtol=tol, atol=tol, msg=lambda m: f"{what}, losses: {m}")
    for key, value in got["weights"].items():
        torch.testing.assert_close(value, want["weights"][key], rtol=tol, atol=tol,
                                   msg=lambda m, k=key: f"{what}, {k}: {m}")


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp2")
    return root, spawn(w.two_ranks, 2, root, str(root), timeout=400)


@pytest.fixture
def two(spawned):
    return spawned[1]


# ---- the numbers -------------------------------------------------------------------------------
def test_pp2_trains_like_one_process_with_the_same_micro_batches(two):
    reference = w.train(None, 4)
    blocks = {0: {"blocks.0", "blocks.1", "wte", "wpe"}, 1: {"blocks.2", "blocks.3", "ln_f", "head"}}
    for rank, result in enumerate(two):
        got = result["plain"]
        assert got["where"] == {"dp": 1, "pp": 2, "pp_rank": rank}
        _close(got, reference, f"rank {rank}: distributed(pp=2)")
        # the stage holds its part, under the whole model's names, and its optimizer steps it
        held = {".".join(k.split(".")[:2]) if k.startswith("blocks") else k.split(".")[0]
                for k in got["weights"]}
        assert held == blocks[rank], held
        assert got["params"] == sum(v.numel() for v in got["weights"].values())
        # the evaluation under no_grad at the end: the whole model's output on every stage
        assert got["eval"] == pytest.approx(reference["eval"], abs=1e-6)


@pytest.mark.parametrize("variant, reference", [
    ("micro4", dict(batch=4, micro=4, epochs=1)),
    ("uneven", dict(batch=3, micro=2, epochs=1, clip=None)),  # micro-batches of 2 and 1
    ("decorated", dict(batch=4, micro=2, epochs=1)),  # @distributed(pp=2, microbatches=2)
    ("accumulate", dict(batch=2, epochs=1, steps_per_group=2)),  # accumulate(2) around it
])
def test_the_loops_variants_train_like_one_process(two, variant, reference):
    want = w.train(None, **reference)
    for rank, result in enumerate(two):
        _close(result[variant], want, f"rank {rank}: {variant}")


def test_pp2_under_bf16_stays_near_one_process_under_bf16(two):
    want = w.train(None, 4, epochs=1, precision="bf16")
    for rank, result in enumerate(two):
        _close(result["bf16"], want, f"rank {rank}: bf16", tol=2e-2)


def test_dp2_by_pp2_and_pp4_train_like_one_process(tmp_path):
    # each pipeline gets 2 rows a step (DDP over "dp" averages the stages' gradients): one
    # process on batches of 4, cut into 4 micro-batches of one row, is the same
    four = spawn(w.four_ranks, 4, tmp_path, timeout=400)
    reference = w.train(None, 4, micro=4)
    for rank, result in enumerate(four):
        got = result["plain"]
        assert got["where"] == {"dp": 2, "pp": 2, "pp_rank": rank % 2}
        _close({"losses": reference["losses"], "weights": got["weights"]}, reference,
               f"rank {rank}: weights on 2 x 2")
        assert got["eval"] == pytest.approx(reference["eval"], abs=1e-6)
        # 1F1B with DDP over "dp" inside torch's stage: the same weights (one epoch)
        _close({"losses": [], "weights": result["1f1b"]["weights"]},
               {"losses": [], "weights": w.train(None, 4, micro=4, epochs=1)["weights"]},
               f"rank {rank}: 1f1b on 2 x 2")
        # pp=4 on the same 4 ranks: a stage per block, the middle ones both receive and send
        _close(result["pp4"], w.train(None, 4, micro=4, epochs=1), f"rank {rank}: pp=4")
        assert result["pp4"]["where"] == {"dp": 1, "pp": 4, "pp_rank": rank}
    for step, want in enumerate(reference["losses"]):  # each pipeline's loss is its half's
        mean = (four[0]["plain"]["losses"][step] + four[2]["plain"]["losses"][step]) / 2
        assert mean == pytest.approx(want, abs=1e-6), step


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe_scheduled"])
def test_a_schedule_given_the_loss_trains_like_one_process(two, schedule):
    # torch's Schedule1F1B / ScheduleGPipe, the loop's call model(x, target=y): the mean of the
    # micro-batches' losses, as torch scales the gradients, is the batch's loss for equal parts
    want = w.train(None, 4, micro=4, epochs=1)
    for rank, result in enumerate(two):
        _close(result[schedule], want, f"rank {rank}: {schedule}")
        assert result[schedule]["eval"] == pytest.approx(want["eval"], abs=1e-6)


@pytest.mark.parametrize("case, text", [
    ("without_target", "call model(x, target=y), which returns the loss"),
    ("accumulated", "inside accumulate(k): the schedule's backward runs inside the call"),
    ("fp16", "its loss scaling finds an overflow per stage"),
])
def test_a_schedule_given_the_loss_refuses_what_it_cannot_honour(two, case, text):
    for rank, result in enumerate(two):
        assert text in result["1f1b_misuses"][case], (rank, result["1f1b_misuses"][case])


# ---- checkpoints -------------------------------------------------------------------------------
def test_what_pp2_saved_loads_into_one_process_bit_for_bit_and_resumes_bit_for_bit(spawned):
    root, two = spawned
    saved = {**two[0]["plain"]["weights"], **two[1]["plain"]["weights"]}
    one = w.resume(str(root / "ckpt"), None, 4)
    assert one["loaded"].keys() == saved.keys()
    for key, value in saved.items():
        assert torch.equal(one["loaded"][key], value), key  # bit for bit
    whole = torch.load(root / "ckpt-model.pt", weights_only=True)  # save_model: every stage's
    assert list(whole) == list(w.LM().state_dict())  # the one-process model's keys, in order
    for key, value in saved.items():
        assert torch.equal(whole[key], value), key
    for rank, result in enumerate(two):  # the same checkpoint back into the pipeline
        resumed = result["resumed"]
        # ...resumes bit for bit as the pipeline that never stopped went on
        assert resumed["losses"] == result["plain"]["then"]["losses"], rank
        for key, value in result["plain"]["then"]["weights"].items():
            assert torch.equal(resumed["weights"][key], value), (rank, key)
        for key, value in resumed["loaded"].items():
            assert torch.equal(value, saved[key]), (rank, key)
        for key, value in resumed["moments"].items():  # AdamW's moments came back too
            assert torch.equal(value, one["moments"][key]) or torch.allclose(
                value, one["moments"][key], atol=1e-7), (rank, key)
        _close({"losses": resumed["losses"], "weights": resumed["weights"]},
               {"losses": one["losses"], "weights": one["weights"]}, f"rank {rank}: resumed")


# ---- misuse --------------------------------------------------------------------------------------
MISUSES = {
    "tied": "wte and head share a parameter (tied weights), and they run on stages 0 and 1",
    "skip": "a skip connection across stages",
    "root_param": "RootParam holds parameters itself (scale)",
    "no_blocks": "has no repeated blocks to cut between",
    "too_few_blocks": "are fewer than the stages; give pp a number up to 1",
    "dict_output": "the model returned something other than a tensor",
    "two_forwards": "a second forward with gradients before the first one's backward",
    "pp3": "cannot form pipeline-parallel groups of 3 ranks",
    "nested": "a nested scope cannot change it",
    "compiled": "torch.compile(model) with a pipeline is not supported yet",
    "no_batch": "without a batched tensor argument",
    "local_sgd": "pipeline parallelism (pp=) each rank holds only part of it",
    "after_called_before": "a part registered after the model's blocks",
    "fp16": "its loss scaling finds an overflow per stage",
    "own_sampler": "Pass num_replicas=state().dp_size, rank=state().dp_rank, or drop the sampler",
    "skipped_block": "the forward returned before calling every block",
}


@pytest.mark.parametrize("case", sorted(MISUSES))
def test_each_misuse_on_two_ranks_names_the_fix_on_every_stage(two, case):
    for rank, result in enumerate(two):
        assert MISUSES[case] in result["misuses"][case], (rank, result["misuses"][case])


def test_a_forward_in_rank_only_code_is_refused_where_it_runs(two):
    assert "runs on some ranks only" in two[0]["misuses"]["rank_only"]
    assert two[1]["misuses"]["rank_only"] == "no error"  # rank 1 never called it


@pytest.mark.parametrize("options, text", [
    (dict(pp=0), "give the number of stages each model is cut into"),
    (dict(pp="2"), "give the number of stages each model is cut into"),
    (dict(pp=2, microbatches=0), "give the number of micro-batches"),
    (dict(microbatches=4), "microbatches=...) without pp="),
    (dict(pp=2, sp=2), "pipeline parallelism with sequence parallelism"),
    (dict(pp=2, tp=2), "pipeline parallelism with tensor parallelism"),
    (dict(pp=2, schedule="1f1b"), "schedule='1f1b') without loss_fn="),
    (dict(pp=2, schedule="zb"), "give one of 'gpipe', '1f1b'"),
    (dict(pp=2, loss_fn="ce"), "give the loss as a function of (output, target)"),
    (dict(loss_fn=len), "loss_fn=...) without pp="),
])
def test_options_are_checked_where_given(options, text):
    with pytest.raises(ConfigurationError, match=text.replace("(", r"\(").replace(")", r"\)")):
        distributed(**options)


def test_sharded_pp_is_refused_with_the_way_that_works():
    from accel_ctx import sharded

    with pytest.raises(ConfigurationError, match=r"Use distributed\(pp=2\)"):
        sharded(pp=2)


def test_the_cut_keeps_the_whole_models_names_and_stands_in_for_the_rest():
    model = w.LM()
    names = set(model.state_dict())
    stage = cut(model, 1, 2, Mailbox())
    assert set(model.state_dict()) == {n for n in names if not n.startswith(
        ("wte", "wpe", "blocks.0.", "blocks.1."))}
    assert (stage.first, stage.stop, stage.last) == (2, 4, True)
    assert len(stage.removed) == 2 + 2 * len(list(w.Block().parameters()))
    assert "wte: before" in repr(model) and "blocks.0: block" in repr(model)


# ---- faults ---------------------------------------------------------------------------------------
def _launch(tmp_path, fault):
    (tmp_path / ".git").mkdir()  # a project root: no config file from above
    script = ROOT / "tests" / "scripts" / "pipeline_stage_fault.py"
    env = {**os.environ, **child_env(), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    proc = subprocess.Popen(
        [ACCEL_CTX, "launch", "-n", "2", str(script), fault], cwd=tmp_path, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=scaled(150))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = output.decode(errors="replace")
    assert proc.returncode != 0, text
    return text, start


def test_a_stage_that_stops_mid_step_is_named_within_the_timeout(tmp_path):
    # SIGSTOP in its forward: the first stage waits in a send to it, which gloo gives up on at
    # distributed(timeout=20); the watch then says who stopped answering
    text, start = _launch(tmp_path, "stops")
    assert "rank 1 caused the failure" in text and "rank 1 stopped answering at step 3" in text, \
        text
    assert time.monotonic() - start < scaled(120), text  # not distributed()'s default 10 min


def test_a_stage_that_dies_mid_step_is_named_by_the_other(tmp_path):
    text, start = _launch(tmp_path, "dies")
    # named by rank 0, or by the launcher when it sees rank 1's exit first and stops the job
    assert ("rank 1 caused the failure" in text or ("rank 1 (local rank 1" in text
            and "exited with code 3" in text)), text
    assert "same inputs" not in text, text  # a pipeline's stages share their inputs by design
    assert time.monotonic() - start < scaled(90), text  # not distributed()'s 60 s timeout x2
