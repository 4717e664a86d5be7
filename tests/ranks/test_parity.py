"""What the peers' users reach for (issue 14), on real ranks: set_epoch, loader positions, loop
awareness, cross-rank decisions, split_between_processes over any sequence."""

from __future__ import annotations

import functools
import operator
import random

import pytest
import torch
from torch.utils.data import DataLoader, Subset

from accel_ctx import (
    all_ranks,
    any_rank,
    distributed,
    load_loader_state,
    loader_state,
    skip_first_batches,
    split_between_processes,
    state,
    synchronize_rng_states,
)
from accel_ctx.errors import ConfigurationError

from .._spawn import spawn
from .._timeouts import scaled
from ..workers import parity


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def ranks(request, tmp_path_factory):
    world = request.param
    metrics = tmp_path_factory.mktemp("metrics")
    results = spawn(parity.run_all, world, tmp_path_factory.mktemp("parity"), str(metrics),
                    timeout=120)
    return world, results, metrics


def _section(results, name):
    return [r[name] for r in results]


# ---- set_epoch ---------------------------------------------------------------------------------
def test_a_users_distributed_sampler_is_told_each_epoch_and_not_sharded_twice(ranks):
    _, results, _ = ranks
    for part in _section(results, "set_epoch"):
        assert part["auto"] == part["expected_auto"]
        assert part["auto"][0] != part["auto"][1]  # reshuffled: the epoch reached the sampler
        assert part["auto_epoch"] == 2
    everything = sorted(i for p in _section(results, "set_epoch") for b in p["auto"][0] for i in b)
    assert everything == list(range(24))


def test_a_loop_that_calls_set_epoch_itself_keeps_its_epochs(ranks):
    _, results, _ = ranks
    for part in _section(results, "set_epoch"):
        assert part["manual"] == part["expected_manual"]


def test_a_streaming_dataset_is_told_each_epoch(ranks):
    _, results, _ = ranks
    for part in _section(results, "set_epoch"):
        assert part["stream_epochs"] == [0, 1]


# ---- loader positions --------------------------------------------------------------------------
def test_loader_state_resumes_with_the_batches_of_a_run_that_never_stopped(ranks):
    world, results, _ = ranks
    for part in _section(results, "positions"):
        assert part["saved_consumed"] == 2 * world  # global batches: every rank's two
        assert part["before"] == part["whole"][0][:2]
        assert part["after"] == part["whole"][0][2:]
        assert part["next_epoch"] == part["whole"][1]


def test_skip_first_batches_skips_this_ranks_batches_once(ranks):
    world, results, _ = ranks
    for rank, part in enumerate(_section(results, "positions")):
        # even_batches (the default) pads the last round with the epoch's first batches
        mine = [[2 * (i % 20), 2 * (i % 20) + 1] for i in range(rank, -(-20 // world) * world,
                                                                 world)]
        assert part["unskipped"] == mine
        assert part["skipped"] == mine[3:]


# ---- loop awareness ----------------------------------------------------------------------------
def test_state_tells_the_batch_index_and_the_last_batch_of_the_loader(ranks):
    world, results, _ = ranks
    for _rank, part in enumerate(_section(results, "awareness")):
        # even_batches (the default) pads the last round: every rank has ceil(6 / W) batches
        count = -(-6 // world)
        assert part["seen"] == [(i, i == count - 1, True) for i in range(count)]
        assert part["before"] == (None, False) and part["after"] == (None, False)
        assert part["stream"][-1] is True and not any(part["stream"][:-1])


# ---- decisions ---------------------------------------------------------------------------------
def test_any_rank_and_all_ranks_give_every_rank_the_same_answer(ranks):
    _, results, _ = ranks
    for part in _section(results, "decisions"):
        assert part["any_last"] is True and part["any_none"] is False
        assert part["all_true"] is True and part["all_one"] is False
        assert part["nan"] is True
        assert part["stopped_after"] == 4  # rank 0 hit its condition first; all stopped there
        assert "one flag per rank" in part["bad_flag"]


def test_synchronize_rng_states_gives_every_rank_rank_zeros_draws(ranks):
    _, results, _ = ranks
    draws = [p["draws"] for p in _section(results, "decisions")]
    assert all(d == draws[0] for d in draws)
    random.seed(0)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(100)
    assert draws[0] == (random.random(), torch.rand(2).tolist(), torch.rand(1, generator=g).item())


def test_split_between_processes_takes_datasets_and_ranges(ranks):
    world, results, _ = ranks
    parts = _section(results, "decisions")
    assert functools.reduce(operator.iadd, (p["squares"] for p in parts), []) == [i * i for i in range(10)]
    assert functools.reduce(operator.iadd, (list(p["range"]) for p in parts), []) == list(range(7))
    assert all(isinstance(p["range"], range) for p in parts)
    k = -(-7 // world)
    assert all(len(p["padded_range"]) == k for p in parts)
    assert functools.reduce(operator.iadd, (list(p["tuple"]) for p in parts), []) == [1, 2, 3, 4, 5]


# ---- one process -------------------------------------------------------------------------------
def test_decisions_in_one_process_are_the_flag_itself():
    assert any_rank(1) is True and all_ranks(0) is False
    with distributed():
        assert any_rank(torch.tensor(True)) is True and all_ranks(torch.tensor(0.0)) is False
        synchronize_rng_states()  # nothing to do, nothing raised
    with pytest.raises(ConfigurationError, match="unknown"):
        synchronize_rng_states(["pyhton"])
    with pytest.raises(ConfigurationError, match=r"torch\.Generator"):
        synchronize_rng_states(generators=[42])  # type: ignore[list-item]


def test_split_between_processes_refuses_what_it_cannot_index():
    with distributed():
        pass
    with pytest.raises(ConfigurationError, match="wrap a single string"):
        _split_in_two("a prompt")
    with pytest.raises(ConfigurationError, match="convert iterators"):
        _split_in_two(iter([1, 2]))


def _split_in_two(items):
    """split_between_processes as rank 0 of 2 sees it, without processes (coordinates faked by
    torch's fake process group would need a store; the rule itself is pure)."""
    from accel_ctx._ranks import evaluation as _evaluation

    _evaluation._length(items, None)
    return _evaluation._split(items, 2, 0, False)


def test_split_of_a_dataset_is_a_subset_view():
    from accel_ctx._ranks import evaluation as _evaluation

    part = _evaluation._split(parity.Squares(), 3, 1, False)
    assert isinstance(part, Subset) and [part[i] for i in range(len(part))] == [16, 25, 36, 49]
    assert split_between_processes(parity.Squares()) is not None  # one process: itself


def test_loader_positions_refuse_what_is_not_a_loader():
    with pytest.raises(ConfigurationError, match="DataLoader"):
        loader_state([1, 2, 3])
    with pytest.raises(ConfigurationError, match="int >= 0"):
        skip_first_batches(DataLoader([1, 2]), -1)
    with pytest.raises(ConfigurationError, match="lacks"):
        load_loader_state(DataLoader([1, 2]), {"epoch": 1})


def test_a_stateful_loader_keeps_its_own_position():
    class Stateful(DataLoader):  # what torchdata's StatefulDataLoader offers
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.loaded = None

        def state_dict(self):
            return {"where": 3}

        def load_state_dict(self, s):
            self.loaded = s

    loader = Stateful([1, 2, 3])
    saved = loader_state(loader)
    assert saved == {"stateful": {"where": 3}}
    load_loader_state(loader, saved)
    assert loader.loaded == {"where": 3}


def test_state_outside_a_loop_names_no_loader():
    s = state()
    assert s.loader is None and s.batch_index == -1 and s.end_of_loader is False


# ---- DDP communication hooks -------------------------------------------------------------------
def _close(a, b, **tol):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], **tol)


def test_comm_hooks_train_as_hand_written_ddp_with_the_same_hook(ranks):
    _, results, _ = ranks
    for part in _section(results, "hooks"):
        for spec in ("none", "fp16", "powersgd", "powersgd-now", "powersgd-rank2"):
            _close(part[spec], part[f"hand_{spec}"], rtol=1e-6, atol=1e-7)
        # within the hook's precision of the uncompressed run, and not the uncompressed run
        _close(part["fp16"], part["none"], rtol=0, atol=2e-3)
        assert any(not torch.equal(part["fp16"][k], part["none"][k]) for k in part["none"])
        assert any(not torch.equal(part["powersgd-now"][k], part["none"][k])
                   for k in part["none"])
        assert "comm_hook='fp16'" in part["bf16_refused"]  # torch's bf16 hook needs NCCL


def test_powersgd_settings_give_each_model_its_own_state(ranks):
    _, results, _ = ranks
    for part in _section(results, "hooks"):
        assert any(not torch.equal(part["powersgd-rank2"][k], part["powersgd-now"][k])
                   for k in part["none"])  # the rank reached torch's hook
        for scoped, hand in zip(part["two_scoped"], part["two_hand"], strict=True):
            _close(scoped, hand, rtol=1e-6, atol=1e-7)
        # one state shared by two models trains otherwise: the scope must not share it
        pairs = zip(part["two_shared"], part["two_hand"], strict=True)
        assert any(not torch.equal(a[k], b[k]) for a, b in pairs for k in a)


def test_powersgd_settings_are_checked_where_given():
    from accel_ctx import PowerSGD

    for bad in ({"rank": 0}, {"start_iter": 1.5}, {"min_compression_rate": -1},
                {"start_iter": 1}):
        with pytest.raises(ConfigurationError, match="PowerSGD"):
            PowerSGD(**bad)
    PowerSGD(start_iter=1, use_error_feedback=False, warm_start=False)  # torch allows it
    assert distributed(comm_hook=PowerSGD(rank=3)).options.comm_hook == PowerSGD(rank=3)
    with pytest.raises(ConfigurationError, match=r"PowerSGD\(rank="):
        distributed(comm_hook=3)


def test_comm_hook_is_checked_and_refused_under_sharded():
    from accel_ctx import sharded

    with pytest.raises(ConfigurationError, match="did you mean 'bf16'"):
        distributed(comm_hook="bf61")
    with pytest.raises(ConfigurationError, match="FSDP2"), sharded(comm_hook="fp16"):
        pass


# ---- find_executable_batch_size ----------------------------------------------------------------
def test_find_executable_batch_size_gives_every_rank_the_size_that_fits_all(ranks):
    world, results, _ = ranks
    parts = _section(results, "batch_sizes")
    smallest = 32 // world  # the last rank fits the least
    agreed = 64
    while agreed > smallest:
        agreed //= 2
    for part in parts:
        assert part["probe"] == agreed
        assert part["tried"] == [64 >> i for i in range(len(part["tried"]))]
        assert part["tried"][-1] == agreed
        assert part["trained_tried"] == [64, 32, 16]  # every rank ran out together
    assert len({p["trained"] for p in parts}) == 1


def test_a_rank_running_out_alone_mid_step_fails_fast_naming_itself(ranks):
    _, results, _ = ranks
    parts = _section(results, "batch_sizes")
    assert "rank 1 ran out of memory at batch size 32" in parts[1]["lopsided"]
    for part in parts:
        assert "rank 1" in part["lopsided"], part["lopsided"]
        assert part["lopsided_seconds"] < scaled(20)  # not the scaled(60) s collective timeout


def test_find_executable_batch_size_in_one_process():
    from accel_ctx import find_executable_batch_size

    calls = []

    @find_executable_batch_size(starting_batch_size=8, min_batch_size=2)
    def never_fits(batch_size, tag):
        calls.append((batch_size, tag))
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate")

    with pytest.raises(ConfigurationError, match="8, 4, 2"):
        never_fits("x")
    assert calls == [(8, "x"), (4, "x"), (2, "x")]

    @find_executable_batch_size
    def other_error(batch_size):
        raise ValueError("not memory")

    with pytest.raises(ValueError, match="not memory"):
        other_error()
    with pytest.raises(ConfigurationError, match="starting_batch_size"):
        find_executable_batch_size(starting_batch_size=0)


# ---- progress and metrics ----------------------------------------------------------------------
def test_progress_yields_every_rank_its_batches_and_draws_on_rank_zero_only(ranks):
    world, results, _ = ranks
    parts = _section(results, "watch")
    for rank, part in enumerate(parts):
        assert part["items"] == [[2 * i, 2 * i + 1] for i in range(rank, 6, world)]
        assert len(part["items"]) == -(-6 // world)
    total = -(-6 // world)
    assert "train: 100%" in parts[0]["drawn"] and f"{total}/{total}" in parts[0]["drawn"]
    assert all(p["drawn"] == "" for p in parts[1:])


def test_log_metrics_writes_once_from_rank_zero_to_csv_and_tensorboard(ranks):
    _, _, metrics = ranks
    rows = (metrics / "metrics.csv").read_text().splitlines()
    assert rows[0] == "step,name,value,time"
    assert [r.split(",")[:3] for r in rows[1:]] == [
        [str(s), name, value] for s in range(3)
        for name, value in (("loss", str(float(s))), ("lr", "0.1"))]
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(metrics))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(0, 0.0), (1, 1.0), (2, 2.0)]


def test_progress_without_tqdm_prints_plain_lines(monkeypatch, capsys):
    from accel_ctx import progress
    from accel_ctx._ranks import watch as _watch

    monkeypatch.setattr(_watch, "_optional", lambda name: None)
    assert list(progress(range(3), desc="eval", every_s=0.0)) == [0, 1, 2]
    err = capsys.readouterr().err.splitlines()
    assert err == ["eval: 1/3", "eval: 2/3", "eval: 3/3", "eval: 3/3 done"]


def test_log_metrics_skips_what_is_not_a_number(tmp_path):
    from accel_ctx import log_metrics

    with pytest.warns(UserWarning, match=r"skipped \['note'\]"):
        log_metrics({"acc": torch.tensor(0.25), "note": "hello"}, step=7, directory=tmp_path)
    assert (tmp_path / "metrics.csv").read_text().splitlines()[1].startswith("7,acc,0.25,")
    with pytest.raises(ConfigurationError, match="dict"):
        log_metrics([("a", 1)], directory=tmp_path)


def test_torchdatas_stateful_dataloader_resumes_through_loader_state():
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    loader = stateful.StatefulDataLoader(list(range(10)), batch_size=2)
    it = iter(loader)
    next(it)
    saved = loader_state(loader)
    fresh = stateful.StatefulDataLoader(list(range(10)), batch_size=2)
    load_loader_state(fresh, saved)
    assert [b.tolist() for b in fresh] == [[2, 3], [4, 5], [6, 7], [8, 9]]


def test_split_of_a_hugging_face_style_dataset_uses_its_select():
    from accel_ctx._ranks import evaluation as _evaluation

    class Table:  # what datasets.Dataset offers: len, indexing, select(indices) -> Dataset
        def __init__(self, rows):
            self.rows = rows

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            return self.rows[i]

        def select(self, indices):
            return Table([self.rows[i] for i in indices])

    part = _evaluation._split(Table(list("abcdefg")), 3, 2, True)
    assert isinstance(part, Table) and part.rows == ["g", "g", "g"]  # padded with the last
