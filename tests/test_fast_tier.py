"""The fast tier (`./dev test --fast`) runs code of every accel_ctx module: the modules that only
multi-process tests reached (tensor parallelism, the debug checks of collectives, the launcher's
signal forwarding, the exact reductions) get their process-free parts checked here, in this
process, in a second or two. Measured with coverage over `pytest --fast` (issue 41)."""

from __future__ import annotations

import os
import signal
import types

import torch
from torch import nn
from torch.distributed.tensor.parallel import SequenceParallel

from accel_ctx._engines import loss_parallel, tensor_parallel, tp_heads, tp_styles
from accel_ctx._group import debug
from accel_ctx._launch import signals
from accel_ctx._ranks import reduce


def test_exact_reductions_combine_rows_of_ranks_and_ignore_ranks_that_do_not_count():
    t = torch.tensor([0.1, 0.2], dtype=torch.float32)
    rows = torch.stack([reduce._as_int64(t), reduce._as_int64(torch.tensor([0.3, 0.4]))])
    total = reduce._combine(rows, t, "sum", 2)
    assert total.dtype == torch.float32
    want = torch.tensor([0.1, 0.2]).double() + torch.tensor([0.3, 0.4]).double()
    assert torch.equal(total, want.float())
    assert torch.equal(reduce._combine(rows, t, "mean", 2), (want / 2).float())
    for op, ints in (("max", torch.tensor([3, -2])), ("min", torch.tensor([3, -2]))):
        none = reduce._identity(ints, op)  # a rank that does not count changes nothing
        both = torch.stack([reduce._as_int64(ints), reduce._as_int64(none)])
        assert torch.equal(reduce._combine(both, ints, op, 2), ints)
    assert reduce._identity(torch.tensor([True]), "min").item() is True


def test_the_debug_check_names_how_ranks_differ():
    call = {"call": "all_reduce", "where": "train.py:3", "tensors": [([4, 2], "float32")]}
    other = {**call, "tensors": [([5, 2], "float32")]}
    assert debug._compare([call, {**call, "call": "gather"}], None, True) == (
        "the ranks are in different calls")
    assert debug._compare([call, other], None, True) == "the ranks pass tensors of different shapes"
    assert debug._compare([call, other], 0, True) is None  # dim 0 may differ
    assert debug._compare([call, {**call, "tensors": [([4, 2], "int64")]}], None, True) == (
        "the ranks pass tensors of different dtypes")
    assert debug._describe(call) == "all_reduce at train.py:3 with tensors [#0 (4, 2) float32]"
    assert "same sequence of collective" in debug._advice("the ranks are in different calls")


def test_tensor_parallel_reads_head_counts_and_declared_plans():
    block = nn.Linear(2, 2)
    block.n_heads, block.n_kv_heads = 8, 2
    assert tp_heads.head_count(block) == ("n_heads", 8)  # the queries' count, the largest
    assert tp_heads.head_count(nn.Linear(2, 2)) is None
    assert tp_styles._is_sequence("sequence_parallel") and tp_styles._is_sequence(SequenceParallel())
    assert not tp_styles._is_sequence("colwise")

    config = types.SimpleNamespace(base_model_tp_plan={"layers.*.q": "colwise"})
    model = nn.Module()
    model.model = nn.Linear(2, 2)
    model.config, model.base_model_prefix = config, "model"
    model._tp_plan = {"lm_head": "colwise_rep"}
    assert tensor_parallel.declared_plan(model) == (("model.layers.*.q", "colwise"),
                                                   ("lm_head", "colwise_rep"))
    assert tensor_parallel.declared_plan(nn.Linear(2, 2)) is None


def test_loss_parallel_is_entered_once_for_nested_scopes_and_left_by_the_last():
    with loss_parallel.loss_parallel_on():
        with loss_parallel.loss_parallel_on():
            assert loss_parallel._users[0] == 2 and len(loss_parallel._open) == 1
        assert len(loss_parallel._open) == 1
    assert loss_parallel._users[0] == 0 and not loss_parallel._open


def test_the_launcher_forwards_sigusr1_while_it_runs_and_restores_the_handler_after():
    before = signal.getsignal(signal.SIGUSR1)
    with signals.forward_sigusr1():
        assert signal.getsignal(signal.SIGUSR1) is not before
    assert signal.getsignal(signal.SIGUSR1) is before
    assert os.getpid() in signals.children_of(os.getppid())  # read from /proc
