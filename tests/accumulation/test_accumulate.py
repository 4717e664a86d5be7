"""accumulate(k) and no_sync(): the same plain loop, gradients accumulated over micro-batches."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from accel_ctx import accumulate, clip_grad_norm_, state

from .._spawn import spawn
from ..workers import accumulation
from ..workers.common import MLP, make_data, params


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return spawn(accumulation.run_all, 2, tmp_path_factory.mktemp("acc"))


def _close(a, b):
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


def test_two_ranks_accumulating_equal_one_rank_with_the_whole_batch(two_ranks):
    # 2 ranks x accumulate(4) x batch 4 == 1 rank x batch 32 (96 samples: 3 steps an epoch)
    reference = accumulation.single_process_reference(96, 32, epochs=2)
    for rank in two_ranks:
        _close(rank["even"]["params"], reference)
        assert rank["even"]["steps"] == 6
        assert rank["even"]["lr"] == pytest.approx(0.2 * 0.9**6)  # the schedule follows real steps


def test_short_last_group_is_scaled_right(two_ranks):
    # 80 samples: 20 global batches of 4, 10 per rank: groups of 4, 4 and 2 micro-batches,
    # like one rank stepping on 32, 32 and 16 samples
    reference = accumulation.single_process_reference(80, 32, epochs=1)
    for rank in two_ranks:
        _close(rank["short_tail"]["params"], reference)
        assert rank["short_tail"]["steps"] == 3
        assert rank["short_tail"]["sync_flags"] == [False, False, False, True] * 2 + [False, True]


def test_one_allreduce_per_optimizer_step(two_ranks):
    for rank in two_ranks:
        # MLP's gradients fit one bucket: one all-reduce per step, none for the other micro-steps
        assert rank["even"]["allreduces"] == rank["even"]["steps"]


def test_fp16_inf_drops_the_whole_group(two_ranks):
    for rank in two_ranks:
        r = rank["fp16"]
        h = r["history"]  # 40 samples, batch 4, 2 ranks: 5 micro-steps per rank: groups 2, 2, 1
        assert len(h) == 5 and r["steps"] == 3 and r["skipped"] == 1
        # the poisoned backward was the 3rd: the group (micro 3, 4) is dropped entirely
        assert all(torch.equal(h[1][k], h[3][k]) for k in h[1])
        assert not torch.equal(h[0]["net.0.weight"], h[1]["net.0.weight"])
        assert not torch.equal(h[3]["net.0.weight"], h[4]["net.0.weight"])  # and training goes on
        assert r["scales"] == [1024.0] * 4 + [512.0]  # constant within groups, halved after


def test_no_sync_keeps_gradients_local_until_the_next_backward(two_ranks):
    a, b = (rank["no_sync"] for rank in two_ranks)
    assert not torch.equal(a["local"], b["local"])
    torch.testing.assert_close(a["synced"], b["synced"])


def test_single_process_accumulation_equals_the_big_batch():
    reference = accumulation.single_process_reference(96, 24, epochs=1)
    with accumulate(3):
        torch.manual_seed(0)
        model = MLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        for x, y in DataLoader(make_data(96), batch_size=8, shuffle=True):
            F.cross_entropy(model(x), y).backward()
            opt.step()
            sched.step()
            opt.zero_grad()
    _close(params(model), reference)


def test_zero_grad_first_order_and_clipping_wait_for_the_boundary():
    torch.manual_seed(0)
    model = nn.Linear(2, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    norms = []
    with accumulate(2):
        for x in torch.ones(4, 1, 2):
            opt.zero_grad()  # the "zero_grad first" order works too
            model(x).sum().backward()
            norms.append(float(clip_grad_norm_(model.parameters(), 0.5)))
            opt.step()
    # micro-steps 1 and 3 report the running norm untouched; 2 and 4 clip the group mean
    assert norms[0] == pytest.approx(2**0.5 / 2) and norms[1] == pytest.approx(2**0.5)
    assert model.weight.grad.norm() == pytest.approx(0.5)


def test_double_step_is_skipped_with_a_warning():
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with accumulate(1):
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        before = params(model)
        with pytest.warns(RuntimeWarning, match="without a new backward"):
            opt.step()
        assert all(torch.equal(before[k], params(model)[k]) for k in before)
        assert state().step == 1


def test_unknown_length_loader_rescales_a_short_tail():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            data = make_data(40)
            return iter(zip(data.tensors[0], data.tensors[1], strict=True))

    def run(batch, steps):
        torch.manual_seed(0)
        model = MLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.3)
        for x, y in DataLoader(Stream(), batch_size=batch):
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        return params(model)

    reference = run(16, 1)  # steps on 16, 16 and 8 samples
    with accumulate(4):
        ours = run(4, 4)  # groups of 4, 4 and 2 micro-batches of 4
    _close(ours, reference)


def test_a_second_scheduler_step_mid_group_waits_and_several_at_the_boundary_run():
    torch.manual_seed(0)
    with accumulate(3):
        model = MLP()
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 0.5**n)
        told = []
        for x, y in DataLoader(make_data(48), batch_size=8, shuffle=True):
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                sched.step()
                sched.step()  # twice each micro-step: mid-group both wait
            told += [str(w.message) for w in caught]
            if state().sync_gradients:
                for _ in range(2):  # Accelerate's world_size calls, at the boundary: they run
                    sched.step()
    # 6 micro-batches, 2 groups: 2 calls + 2 guarded calls at each boundary
    assert sched.last_epoch == 8, sched.last_epoch
    assert len(told) == 1 and "held back" in told[0] and "sync_gradients" in told[0], told


def test_a_resume_through_dcps_set_state_dict_is_not_a_step():
    # torch.distributed.checkpoint's set_state_dict() fills a fresh optimizer's state with one
    # step() at lr 0 (_init_optim_state): counted as a training step, it moved state().step and
    # let the first mid-group scheduler step of the resumed run through
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def lrs_of_a_run(resume: bool) -> tuple[list[float], int]:
        torch.manual_seed(0)
        batches = list(DataLoader(make_data(32), batch_size=4, shuffle=True))
        model = MLP()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 1 / (n + 1))
        with accumulate(2):
            for x, y in batches[:4]:  # two whole groups
                F.cross_entropy(model(x), y).backward()
                opt.step()
                sched.step()
                opt.zero_grad()
            if resume:  # a second job: fresh objects, the state loaded before the first forward
                saved_model, saved_opt = get_state_dict(model, opt)
                saved_sched = sched.state_dict()
                model = MLP()
                opt = torch.optim.AdamW(model.parameters(), lr=0.01)
                sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 1 / (n + 1))
                set_state_dict(model, opt, model_state_dict=saved_model,
                               optim_state_dict=saved_opt)
                sched.load_state_dict(saved_sched)
            steps_at_resume = state().step
            lrs = []
            for x, y in batches[4:]:
                F.cross_entropy(model(x), y).backward()
                opt.step()
                sched.step()
                opt.zero_grad()
                lrs.append(opt.param_groups[0]["lr"])
        return lrs, steps_at_resume

    whole, _ = lrs_of_a_run(resume=False)
    resumed, steps_at_resume = lrs_of_a_run(resume=True)
    assert resumed == whole
    assert steps_at_resume == 2  # the two groups trained, not the optimizer's state being filled


def test_loading_a_stateless_optimizer_through_dcp_is_not_a_step():
    # plain SGD keeps no state, so DCP fills it with a step() at lr 0 at every load; before
    # the first backward (where a resume loads) that step was counted
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.manual_seed(0)
    with accumulate(2):
        model = MLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        saved_model, saved_opt = get_state_dict(model, opt)
        set_state_dict(model, opt, model_state_dict=saved_model, optim_state_dict=saved_opt)
        assert state().step == 0
        for x, y in DataLoader(make_data(16), batch_size=4):
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        assert state().step == 2
