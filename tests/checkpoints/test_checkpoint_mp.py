"""save_state / load_state on real ranks (spawned, gloo): resumed runs end where uninterrupted
ones do, on the same number of ranks bit for bit, on another number as the math allows.

A 2-rank loop with shuffle, dropout, mixed_precision("fp16") (a loss scale that starts too
high, so steps are skipped and the scale moves) and accumulate(2), AdamW and StepLR, stopped
at several points and resumed in fresh processes, ends bit-identical to the run that never
stopped: parameters, optimizer state, learning rate, step and skip counters, loss scale, the
batches seen, and what Python's and NumPy's generators drew.

Resuming on another number of ranks W' is exact math only when an optimizer step sees the
same samples: W' x k' = W x k micro-batches per step, and the checkpoint taken at a step
boundary. Saved on 2 ranks with accumulate(3) (6 loader batches per step), resumed on 1 rank
with accumulate(6) and on 3 ranks with accumulate(2), every step averages the gradients of the
same 6 batches (the loader position is kept in global batches and the permutations come from
rank 0's RNG), so the result is allclose (fp32; only the summation order differs). Anything else
(other batch per step, a checkpoint inside an accumulation group) trains on, but differently.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .. import _launcher
from .._spawn import spawn
from ..workers import checkpoint as ck

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt")
    root = str(tmp / "ck")
    stopped = spawn(ck.stop_and_reference, 2, tmp, root, timeout=300)
    resumed = spawn(ck.resume_same_world, 2, tmp, root, timeout=300)
    return root, tmp, stopped, resumed


def _equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("stop", list(ck.STOPS))
def test_resumed_run_is_bit_identical_to_the_uninterrupted_one(runs, stop):
    _, _, stopped, resumed = runs
    for rank in range(2):
        full, before, after = stopped[rank]["full"], stopped[rank][stop], resumed[rank][stop]
        _equal(after["params"], full["params"])
        _equal(after["optimizer"], full["optimizer"])
        for key in ("lr", "step", "skipped", "scale"):
            assert after[key] == full[key], key
        assert before["seen"] + after["seen"] == full["seen"]  # each batch once, same order
        assert after["noise"] == full["noise"][-len(after["noise"]):]  # python + numpy RNG


def test_the_fp16_scale_moved_and_steps_were_skipped(runs):
    full = runs[2][0]["full"]
    assert full["skipped"] > 0 and full["scale"] != 2.0**20


def test_load_state_says_where_it_resumes(runs):
    _, _, stopped, resumed = runs
    # 96 samples, batch 4, 2 ranks: 12 micro-batches per rank and epoch, 6 steps
    expected = {"mid_group": (2, 0), "boundary": (4, 0), "epoch_end": (6, 1),
                "second_epoch": (9, 1)}
    for stop, (step, epoch) in expected.items():
        assert stopped[0][stop]["step"] == step
        assert resumed[0][stop]["resumed"] == (step, epoch, 2)


def test_loaders_not_passed_by_name_are_matched_by_order(runs):
    _, _, stopped, resumed = runs
    for rank in range(2):
        full, before, after = (stopped[rank]["full_unnamed"], stopped[rank]["unnamed"],
                               resumed[rank]["unnamed"])
        _equal(after["params"], full["params"])
        assert before["seen"] + after["seen"] == full["seen"]  # the eval loader's too


def test_a_stopped_run_leaves_its_checkpoint_and_no_temporary_folder(runs):
    root = Path(runs[0])
    assert len([p for p in (root / "mid_group").iterdir()]) == 1
    assert not [p for p in root.rglob(".tmp-*")]


def test_ranks_drawing_different_amounts_resume_exactly(runs):
    _, _, stopped, resumed = runs
    full, before, after = (stopped[1]["uneven_rng_full"], stopped[1]["uneven_rng_stop"],
                           resumed[1]["uneven_rng"])
    assert before + after == full


@pytest.mark.parametrize("world", [1, 3])
def test_saved_on_2_ranks_resumed_on_another_number(runs, world):
    root, tmp, stopped, _ = runs
    results = spawn(ck.resume_other_world, world, tmp, root, timeout=300)
    reference = stopped[0]["reshard_full"]
    for r in results:
        other = r["same_batch"]
        assert other["step"] == reference["step"] and other["resumed"] == (2, 0, 2)
        for key, value in reference["params"].items():
            torch.testing.assert_close(other["params"][key], value, rtol=1e-5, atol=1e-6)
        for key, value in reference["optimizer"].items():
            torch.testing.assert_close(other["optimizer"][key], value, rtol=1e-5, atol=1e-6)
        assert other["lr"] == pytest.approx(reference["lr"])
    if world == 1:  # saved inside an accumulation group: warns, drops the partial group, goes on
        (only,) = results
        assert any("partial gradients" in w for w in only["warnings"])
        assert all(torch.isfinite(v).all() for v in only["mid_group"]["params"].values())
        assert only["mid_group"]["step"] > stopped[0]["mid_group"]["step"]


@pytest.mark.slow
def test_a_killed_rank_restarts_from_the_newest_checkpoint_and_ends_the_same(runs, tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    script = str(ROOT / "tests" / "scripts" / "checkpoint_train.py")
    # forked from tests/_zygote.py's server, the launcher and the restarted workers too
    proc, log = _launcher.start(["-n", "2", "--max-restarts", "1", script, str(ckpt), str(out),
                                 "10"], tmp_path, "job.log")
    code = _launcher.finish(proc, 300)
    assert code == 0, log.read_text()
    # attempt 0 started fresh; rank 1 died after 10 micro-batches (checkpoints at 4 and 8);
    # attempt 1 resumed from the one at micro-batch 8 = optimizer step 4
    assert [(out / f"attempt0.rank{r}").read_text() for r in range(2)] == ["0", "0"]
    assert [(out / f"attempt1.rank{r}").read_text() for r in range(2)] == ["4", "4"]
    full = runs[2][0]["full"]
    for rank in range(2):
        final = torch.load(out / f"final.rank{rank}.pt", weights_only=True)
        assert final["step"] == full["step"]
        _equal(final["params"], full["params"])
        _equal(final["optimizer"], full["optimizer"])
