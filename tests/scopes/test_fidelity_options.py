"""Options are checked where they are given, the same way for every public name (issue #23,
points 10 and 11): a misspelt keyword says "did you mean", a string where a flag is expected is
refused instead of read as True, an out-of-range value names the fix, all before anything
happens; loader positions that do not fit the loader, and skips past the end of the epoch, are
refused with the numbers instead of emptying an epoch without a word.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import accel_ctx
from accel_ctx import (
    PowerSGD,
    accumulate,
    all_ranks,
    any_rank,
    broadcast,
    clip_grad_norm_,
    distributed,
    find_executable_batch_size,
    get_logger,
    launch,
    load_loader_state,
    load_state,
    loader_state,
    log_metrics,
    main_print,
    main_process_first,
    mixed_precision,
    no_sync,
    pad_across_processes,
    progress,
    reduce,
    save_model,
    save_state,
    sharded,
    skip_first_batches,
    split_between_processes,
    synchronize_rng_states,
)
from accel_ctx.errors import ConfigurationError

from .._spawn import spawn
from ..workers import fidelity_options as w

# ---- misspelt options: one message, for every public name ----------------------------------
# The positional arguments each public name needs, so that only the unknown keyword is wrong.
_NEEDS: dict[str, tuple[Any, ...]] = {
    "accumulate": (2,), "all_ranks": (True,), "any_rank": (True,), "autocast_forward": (len,),
    "broadcast": (1,), "broadcast_object": (1,), "clip_grad_norm_": ([], 1.0),
    "clip_grad_value_": ([], 1.0), "gather": (1,), "gather_for_metrics": (1,),
    "gather_object": (1,), "launch": (len,), "load_loader_state": (None, {}),
    "loader_state": (None,), "log_metrics": ({},), "on_process": (0,),
    "pad_across_processes": (1,), "progress": ([],), "reduce": (1,), "save_model": (None, "m"),
    "skip_first_batches": (None, 0), "split_between_processes": ([],),
}
_RECORDS = {"DistributedOptions", "PrecisionPolicy", "Resumed", "State", "errors"}
# these take any keyword: objects to checkpoint by name (an unrelated name is an object)
_OBJECTS = {"save_state", "load_state"}


@pytest.mark.parametrize("name", sorted(set(accel_ctx.__all__) - _RECORDS - _OBJECTS))
def test_every_public_name_refuses_an_unknown_keyword_by_name(name):
    fn = getattr(accel_ctx, name)
    with pytest.raises(ConfigurationError) as info:
        fn(*_NEEDS.get(name, ()), zzz_typo=1)
    assert f"{name}() got an unknown option 'zzz_typo'" in str(info.value)


@pytest.mark.parametrize(
    ("call", "said", "meant"),
    [
        (lambda: sharded(blokcs=[nn.Linear]), "sharded", "blocks"),
        (lambda: sharded(timeuot=3), "sharded", "timeout"),  # distributed()'s, via sharded()
        (lambda: distributed(timeuot=3), "distributed", "timeout"),
        (lambda: mixed_precision("bf16", init_scal=2.0), "mixed_precision", "init_scale"),
        (lambda: accumulate(stesp=2), "accumulate", "steps"),
        (lambda: reduce(1, opp="sum"), "reduce", "op"),
        (lambda: broadcast(1, scr=0), "broadcast", "src"),
        (lambda: log_metrics({"a": 1}, stpe=1), "log_metrics", "step"),
        (lambda: find_executable_batch_size(startng_batch_size=8), "find_executable_batch_size",
         "starting_batch_size"),
        (lambda: progress([1], dsec="x"), "progress", "desc"),
        (lambda: get_logger("x", levl=10), "get_logger", "level"),
        (lambda: launch(len, nproc=1), "launch", "nprocs"),
        (lambda: save_state("unused", keep_lst=2), "save_state", "keep_last"),
        (lambda: load_state("unused", requird=True), "load_state", "required"),
        (lambda: PowerSGD(rnak=2), "PowerSGD", "rank"),
        (lambda: clip_grad_norm_([], max_nrom=1.0), "clip_grad_norm_", "max_norm"),
        (lambda: synchronize_rng_states(generator=[]), "synchronize_rng_states", "generators"),
        (lambda: split_between_processes([1], pda=True), "split_between_processes", "pad"),
        (lambda: main_process_first(locl=True), "main_process_first", "local"),
        (lambda: pad_across_processes(1, pad_frist=True), "pad_across_processes", "pad_first"),
    ],
)
def test_a_misspelt_option_says_which_was_meant(call, said, meant, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigurationError) as info:
        call()
    message = str(info.value)
    assert f"{said}() got an unknown option" in message, message
    assert f"did you mean {meant!r}?" in message.lower(), message
    assert not any(tmp_path.iterdir())  # nothing written, no checkpoint folder made


def test_arguments_that_do_not_fit_name_the_call_and_its_signature():
    with pytest.raises(ConfigurationError, match=r"no_sync\(\): too many positional"):
        no_sync(2)  # type: ignore[call-arg]
    with pytest.raises(ConfigurationError, match=r"accumulate\(\): missing .*'steps'"):
        accumulate()  # type: ignore[call-arg]
    with pytest.raises(ConfigurationError, match=r"no_sync\(\) takes no options"):
        no_sync(steps=2)  # type: ignore[call-arg]


def test_a_type_error_inside_the_function_is_not_taken_for_a_misspelt_option():
    with pytest.raises(TypeError, match="not the class"):
        accel_ctx.on_main_process()(int)  # raised by the function itself: passed through


# ---- flags: a string is refused, not read as True ------------------------------------------
@pytest.mark.parametrize(
    ("call", "option"),
    [
        (lambda v: sharded(cpu_offload=v), "cpu_offload"),
        (lambda v: sharded(hybrid=v), "hybrid"),
        (lambda v: sharded(debug=v), "debug"),
        (lambda v: distributed(even_batches=v), "even_batches"),
        (lambda v: split_between_processes([1, 2], pad=v), "pad"),
        (lambda v: load_state("unused", required=v), "required"),
        (lambda v: get_logger("x", all_ranks=v), "all_ranks"),
        (lambda v: pad_across_processes(torch.ones(2), pad_first=v), "pad_first"),
        (lambda v: main_process_first(local=v).__enter__(), "local"),
        (lambda v: PowerSGD(batched=v), "batched"),
        (lambda v: clip_grad_norm_([], 1.0, error_if_nonfinite=v), "error_if_nonfinite"),
    ],
)
@pytest.mark.parametrize("value", ["no", "yes", 1])
def test_a_flag_takes_true_or_false_only(call, option, value, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigurationError) as info:
        call(value)
    message = str(info.value)
    assert f"({option}={value!r})" in message and "True or False" in message, message
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("flag", ["no", "yes", None, [], [False]])
def test_any_rank_and_all_ranks_refuse_what_is_no_flag(flag):
    for decide in (any_rank, all_ranks):
        with pytest.raises(ConfigurationError, match="a bool, a number or a one-element tensor"):
            decide(flag)
    assert any_rank(torch.tensor(1)) and not all_ranks(0) and any_rank(True)


# ---- values out of range ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("call", "said"),
    [
        (lambda: mixed_precision("fp16", init_scale="2"), "init_scale='2'"),
        (lambda: mixed_precision("fp16", init_scale=-1.0), "init_scale=-1.0"),
        (lambda: mixed_precision("fp16", init_scale=math.nan), "init_scale=nan"),
        (lambda: mixed_precision("fp16", init_scale=True), "init_scale=True"),
        (lambda: mixed_precision("fp16", growth_interval=0), "growth_interval=0"),
        (lambda: mixed_precision("fp16", growth_interval=2.5), "growth_interval=2.5"),
        (lambda: progress([1], total="x"), "total='x'"),
        (lambda: progress([1], every_s=-1), "every_s=-1"),
        (lambda: progress([1], desc=3), "desc=3"),
        (lambda: progress(5), "progress(5)"),
        (lambda: get_logger("x", level="LOUD"), "level='LOUD'"),
        (lambda: get_logger(3), "name=3"),  # type: ignore[arg-type]
        (lambda: synchronize_rng_states("torch"), "kinds='torch'"),
        (lambda: synchronize_rng_states(src=1), "src=1"),
        (lambda: broadcast(torch.ones(1), src="0"), "src='0'"),
        (lambda: pad_across_processes(torch.ones(2), dim="0"), "dim='0'"),
        (lambda: clip_grad_norm_([], "1"), "max_norm='1'"),
        (lambda: launch(len, nprocs=1, timeout="5"), "timeout='5'"),
        (lambda: launch(len, nprocs=1, args=3), "args=3"),
        (lambda: launch(len, nprocs=1, env={"A": 1}), "env={'A': 1}"),
        (lambda: launch(3, nprocs=1), "launch(3)"),
        (lambda: save_state(5), "directory=5"),
        (lambda: save_model("net", "m.pt"), "takes a torch.nn.Module"),
        (lambda: save_model(nn.Linear(1, 1), 3), "path=3"),
        (lambda: PowerSGD(seed=-1), "seed=-1"),
        (lambda: main_print("x", sep=3), "sep=3"),
        (lambda: find_executable_batch_size(3), "find_executable_batch_size(3)"),
    ],
)
def test_a_value_out_of_range_names_option_value_and_fix(call, said, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigurationError) as info:
        call()
    assert said in str(info.value), str(info.value)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("step", ["x", -1, 1.5, True])
def test_log_metrics_refuses_a_bad_step_before_writing_a_row(step, tmp_path):
    with pytest.raises(ConfigurationError, match=r"log_metrics\(step="):
        log_metrics({"loss": 0.5}, step=step, directory=tmp_path / "runs")
    assert not (tmp_path / "runs").exists()
    log_metrics({"loss": 0.5}, step=3, directory=tmp_path / "runs")  # a good one still works
    assert (tmp_path / "runs" / "metrics.csv").read_text().splitlines()[1].startswith("3,loss,")


def test_find_executable_batch_size_refuses_a_minimum_above_the_start():
    calls = []
    with pytest.raises(ConfigurationError) as info:
        @find_executable_batch_size(starting_batch_size=4, min_batch_size=8)
        def train(batch_size: int) -> int:
            calls.append(batch_size)
            return batch_size
    message = str(info.value)
    assert "starting_batch_size=4" in message and "min_batch_size=8" in message, message
    assert "tried ()" not in message and calls == []


def test_good_values_are_still_taken():
    policy = mixed_precision("fp16", init_scale=1024, growth_interval=10)
    assert policy._options[1:] == (1024.0, 10)
    scope = sharded(cpu_offload=False, hybrid=True, blocks=[nn.Linear])
    assert scope.plan.hybrid is True and scope.plan.cpu_offload is False
    assert list(progress(range(3), desc="d", total=3, every_s=0.5, disable=True)) == [0, 1, 2]
    assert split_between_processes([1, 2], pad=True) == [1, 2]
    assert not get_logger("fidelity", all_ranks=True, level="INFO").isEnabledFor(10)
    assert pad_across_processes(torch.ones(2), dim=3, pad_index=False).shape == (2,)


# ---- sharded(blocks=...) that the model does not have ---------------------------------------
@pytest.mark.parametrize("blocks", [[nn.Conv2d], lambda m: isinstance(m, nn.Conv2d)])
def test_blocks_the_model_lacks_are_refused_naming_its_candidates(blocks):
    with distributed(), sharded(blocks=blocks):
        model = w.Net()
        with pytest.raises(ConfigurationError) as info:
            model(torch.ones(2, 4))
    message = str(info.value)
    assert message.startswith("sharded(blocks="), message
    assert "Block (x3)" in message and "sharded(blocks=[Block])" in message, message
    with distributed(), sharded(blocks=[w.Block]):  # blocks it has: fine
        w.Net()(torch.ones(2, 4)).sum().backward()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return spawn(w.misuse, 2, tmp_path_factory.mktemp("fidelity-options"), timeout=300)


def test_blocks_the_model_lacks_are_refused_on_every_rank_before_sharding(two_ranks):
    for result in two_ranks:
        for name in ("missing_class", "missing_fn"):
            assert result[name] is not None and "ConfigurationError" in result[name], result
            assert "Block (x3)" in result[name], result[name]
            assert result[f"{name}_left_unsharded"]
        assert result["named_blocks_shard"]


# ---- loader positions (point 10) -----------------------------------------------------------
def _loader(n: int) -> DataLoader[Any]:
    return DataLoader(list(range(n)), batch_size=2)


@pytest.mark.parametrize("saved", [None, "state", 5, ["epoch"]])
def test_load_loader_state_refuses_what_is_no_saved_state(saved):
    with pytest.raises(ConfigurationError, match="give the dict loader_state"):
        load_loader_state(_loader(8), saved)


def test_a_position_of_another_loader_is_refused_naming_both_sizes():
    big = _loader(20)  # 10 batches
    with distributed():
        it = iter(big)
        for _ in range(7):
            next(it)
        saved = loader_state(big)
        del it
    small = _loader(8)  # 4 batches
    with pytest.raises(ConfigurationError) as info:
        load_loader_state(small, saved)
    assert "10 batches" in str(info.value) and "has 4" in str(info.value), str(info.value)
    old_format = {k: v for k, v in saved.items() if k != "batches"}  # saved before the size
    with pytest.raises(ConfigurationError) as info:
        load_loader_state(small, old_format)
    assert "7 batches" in str(info.value) and "has 4 per epoch" in str(info.value)
    with pytest.raises(ConfigurationError, match="consumed=-1"):
        load_loader_state(small, {**saved, "consumed": -1})
    with pytest.raises(ConfigurationError, match="this DataLoader has no state_dict"):
        load_loader_state(small, {"stateful": {}})
    again = _loader(20)
    load_loader_state(again, saved)  # a loader like the one it was taken from: resumes
    with distributed():
        assert [b.tolist() for b in again] == [[14, 15], [16, 17], [18, 19]]


def test_skip_first_batches_past_the_end_of_the_epoch_says_so():
    loader = _loader(8)  # 4 batches
    with pytest.raises(ConfigurationError) as info:
        skip_first_batches(loader, 5)  # outside a scope too: past the end anywhere
    assert "skip_first_batches(loader, 5)" in str(info.value) and "has 4 batches" in str(
        info.value), str(info.value)
    with distributed():
        with pytest.raises(ConfigurationError, match=r"epoch has 4 batches"):
            skip_first_batches(loader, 9)
        assert list(skip_first_batches(loader, 4)) == []  # exactly the epoch: allowed, empty
        assert len(list(loader)) == 4  # the skip was once


def test_skip_first_batches_counts_this_ranks_batches_on_two_ranks(two_ranks):
    for result in two_ranks:
        for name in ("skip_at_iteration", "skip_at_call"):
            message = result[name]
            assert message is not None and "this rank's epoch has 2 batches" in message, message
            assert "of 4 over 2 ranks" in message, message
        assert result["skip_all"] == [] and len(result["next_epoch"]) == 2
