"""Sequence parallelism (issue 56): ``distributed(sp=N)`` / ``sharded(sp=N)`` train the plain
loop as one process does on the whole sequence, with Ulysses attention (torch's SDPA between
two all-to-alls) on real gloo ranks; each misuse ends in a message that names the fix."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from accel_ctx import distributed, sharded
from accel_ctx._data.sequence_split import split_batch
from accel_ctx._job.sequence import SequenceShare
from accel_ctx.errors import ConfigurationError

from .._spawn import spawn
from .._timeouts import scaled
from ..workers import sequence_parallel as w
from ..workers.tensor_parallel import has_transformers


def _close(got, want, what, rtol=1e-5, atol=1e-5):
    assert len(got["losses"]) == len(want["losses"]), what
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]),
                               rtol=rtol, atol=atol, msg=lambda m: f"{what}, losses: {m}")
    assert got["weights"].keys() == want["weights"].keys(), what
    for key, value in want["weights"].items():
        torch.testing.assert_close(got["weights"][key], value, rtol=rtol, atol=atol,
                                   msg=lambda m, k=key: f"{what}, {k}: {m}")


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    root = tmp_path_factory.mktemp("sp2")
    return root, spawn(w.two_ranks, 2, root, str(root), timeout=400)


@pytest.fixture
def two(spawned):
    return spawned[1]


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return spawn(w.four_ranks, 4, tmp_path_factory.mktemp("sp4"), timeout=400)


# ---- the numbers -------------------------------------------------------------------------------
def test_sp2_trains_like_one_process_on_the_whole_sequence(two):
    # labels with -100: the ranks' slices count different numbers of tokens every step
    reference = w.train("one", 4)
    for rank, result in enumerate(two):
        assert result["plain"]["where"] == {"dp": 1, "sp": 2, "sp_rank": rank}
        _close(result["plain"], reference, f"rank {rank}: distributed(sp=2)")
        # reduce() counts each data-parallel group once: the step's loss, not twice it
        assert result["plain"]["mean_loss"] == pytest.approx(reference["losses"][-1], abs=1e-5)


@pytest.mark.parametrize("variant, reference", [
    ("accumulate", dict(batch=2, steps_per_group=2)),
    ("tuples", dict(batch=4, as_tuples=True, epochs=1)),  # (x, y) batches: y counts
    ("whole_positions", dict(batch=4, epochs=1)),  # the loop's own 0..T-1: sliced
    ("decorated", dict(batch=4)),  # @distributed(sp=2)
])
def test_the_loops_variants_train_like_one_process(two, variant, reference):
    want = w.train("one", **reference)
    for rank, result in enumerate(two):
        _close(result[variant], want, f"rank {rank}: {variant}")


def test_sp2_under_bf16_stays_near_one_process_under_bf16(two):
    want = w.train("one", 4, precision="bf16", epochs=1)
    for rank, result in enumerate(two):
        _close(result["bf16"], want, f"rank {rank}: bf16", rtol=2e-2, atol=2e-2)


def test_what_sp_saved_loads_without_sp(spawned):
    root, two = spawned
    for rank, result in enumerate(two):  # on 2 data-parallel ranks, in the same run
        for key, value in result["plain"]["weights"].items():
            assert torch.equal(result["loaded"][key], value), (rank, key)
    got = w.load_into(str(root))  # and in one process
    for key, value in two[0]["plain"]["weights"].items():
        assert torch.equal(got[key], value), key


def test_dp2_by_sp2_with_ddp_and_fsdp2_trains_like_hand_written_ddp(four):
    # each data-parallel group's loss is the mean over its own tokens, as DDP averages it:
    # one process accumulating the two groups' micro-batches is the same
    reference = w.train("one", 2, steps_per_group=2)
    for rank, result in enumerate(four):
        for kind in ("distributed", "sharded"):
            got = result[kind]
            assert got["where"] == {"dp": 2, "sp": 2, "sp_rank": rank % 2}, kind
            group_losses = {"losses": reference["losses"][rank // 2::2],
                            "weights": reference["weights"]}
            _close(got, group_losses, f"rank {rank}: {kind}(sp=2) on 2 x 2")


@pytest.mark.skipif(not has_transformers(), reason="needs transformers")
def test_hf_gpt2_and_llama_with_sdpa_train_like_one_process(tmp_path, monkeypatch):
    # their own label shift and loss: the scope hands them the whole sequence's shift_labels
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    got = spawn(w.hf_two_ranks, 2, tmp_path, timeout=400)
    for name in ("gpt2", "llama"):
        want = w.train_hf(name, "one", 4)
        for rank, result in enumerate(got):
            _close(result[name], want, f"rank {rank}: {name}")


# ---- misuse --------------------------------------------------------------------------------------
MISUSES = {
    "nano": "NanoLM.forward takes no position_ids",
    "eager": "called no F.scaled_dot_product_attention",
    "heads": "attention has 1 query heads, which do not split over 2 ranks",
    "kv_heads": "attention has 1 key/value heads",
    "flat": "Ulysses needs (batch, heads, sequence, head_dim)",
    "length": "sequences are 15 tokens long, which does not split into 2 equal slices",
    "mask": "got an attn_mask",
    "by_hand": "ran attention on inputs that are no slices of a batch from a DataLoader",
    "derived": "ran attention on inputs that are no slices of a batch from a DataLoader",
    "local_positions": "position_ids of length 8, a slice's length",
    "sp3": "cannot form sequence-parallel groups of 3 ranks",
    "nested": "a nested scope cannot change it",
    "local_sgd": "under sp= each rank's gradient is only its slice",
    "deepspeed": "DeepSpeed's ZeRO with sequence parallelism is not supported",
}


@pytest.mark.parametrize("case", sorted(MISUSES))
def test_each_misuse_on_two_ranks_names_the_fix(two, case):
    if case == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs deepspeed: without it, the missing extra is refused first")
    for rank, result in enumerate(two):
        assert MISUSES[case] in result["misuses"][case], (rank, result["misuses"][case])


@pytest.mark.parametrize("value, text", [
    (0, "give the number of ranks that split each sequence"),
    ("2", "give the number of ranks that split each sequence"),
    (True, "give the number of ranks that split each sequence"),
    (2.0, "give the number of ranks that split each sequence"),
])
def test_a_bad_sp_is_refused_where_it_is_given(value, text):
    with pytest.raises(ConfigurationError, match=text):
        distributed(sp=value)


def test_sp_with_tp_is_refused_naming_both():
    with pytest.raises(ConfigurationError, match=r"sharded\(sp=2, tp=2\): sequence and tensor"):
        sharded(sp=2, tp=2)


def test_sp2_in_one_process_says_how_many_to_start():
    with pytest.raises(ConfigurationError, match=r"launch -n 2"), distributed(sp=2):
        pass


def test_sp1_is_no_split():
    with distributed(sp=1):
        from accel_ctx import state

        assert (state().sp_size, state().dp_size) == (1, 1)


# ---- the split's rule ----------------------------------------------------------------------------
def test_the_split_slices_every_sequence_tensor_and_keeps_per_sample_ones():
    share = SequenceShare(2, 1)
    ids = torch.arange(16).view(2, 8)
    labels = ids.clone()
    labels[0, 5:] = -100  # rank 1's slice of sample 0: 1 counted token; rank 0's: 4
    batch = {"input_ids": ids, "labels": labels, "mask": torch.ones(2, 8), "n": torch.ones(2),
             "other": torch.zeros(2, 3)}
    out = split_batch(share, batch)
    assert out["input_ids"].tolist() == [[4, 5, 6, 7], [12, 13, 14, 15]]
    assert out["mask"].shape == (2, 4) and out["n"].shape == (2,) and out["other"].shape == (2, 3)
    assert share.is_slice(out["labels"]) and not share.is_slice(batch["labels"])
    assert share.counts == ([8, 5], [8, 3])  # labels; labels shifted by one (HF)
    factor, part = share.loss_weight()
    assert part == pytest.approx(5 / 13) and factor == pytest.approx(2 * 5 / 13)
    assert share.positions(out["input_ids"]).tolist() == [[4, 5, 6, 7]] * 2


def test_a_batch_without_sequences_stays_whole_and_counts_nothing():
    share = SequenceShare(2, 0)
    batch = (torch.ones(4), torch.arange(4))
    assert split_batch(share, batch) is batch
    assert share.loss_weight() is None


def test_the_pages_example_gives_one_processes_loss(tmp_path):
    from ..package.test_docs import _blocks
    from ..workers.docs_blocks import run_block

    block = next(b for b in _blocks() if b["where"].startswith("long-sequences.md"))
    code = str(block["code"])
    one = code.replace("with distributed(sp=2):", "if True:")  # the same loop, one process
    want = run_block(one, "one process", "last")
    for rank, last in enumerate(spawn(run_block, 2, tmp_path, code, block["where"], "last")):
        assert last == pytest.approx(want, abs=1e-5), rank


# ---- faults ------------------------------------------------------------------------------------
def test_a_peer_that_dies_before_the_attention_is_named_at_once(tmp_path):
    import pickle

    results = spawn(w.dead_peer, 2, tmp_path, timeout=120, expect_failure=True)
    assert results[1] == "no result"  # it died
    kind, message, seconds = pickle.loads(results[0])
    assert kind == "DistributedError" and "rank 1's process died" in message, message
    assert "while rank 0 was in forward" in message, message
    assert seconds < scaled(20)  # not its 60 s timeout


def test_a_peer_that_stalls_is_named_by_the_rank_that_waited_in_the_all_to_all(tmp_path):
    import pickle

    waited, stalled = (pickle.loads(r) for r in spawn(w.stalled_peer, 2, tmp_path, timeout=120,
                                                        expect_failure=True))
    assert waited[0] == "DistributedError" and "rank 1 stopped answering at step 2" in waited[1]
    assert "rank 0 timed out waiting for it in forward" in waited[1], waited[1]
    assert "This rank is the one named" in stalled[1], stalled[1]  # no blame on rank 0


def test_a_model_compiled_inside_sp_traces_its_attention_without_a_graph_break(tmp_path):
    # the all-to-alls are traced with the attention: one graph, as the model outside a scope
    want = w.train("one", 4, epochs=1)
    for rank, got in enumerate(spawn(w.compiled, 2, tmp_path, timeout=400)):
        assert got["breaks"] == {}, (rank, got["breaks"])
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]),
                                   rtol=1e-5, atol=1e-5)
