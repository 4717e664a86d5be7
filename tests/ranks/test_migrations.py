"""Scripts moved from Accelerate, DDP and Fabric keep working: Accelerate's logging calls and
scheduler arithmetic and order, a DDP version's checkpoint, Fabric's gather of a number."""

from __future__ import annotations

import pytest

from .._spawn import spawn
from ..workers import migrate

WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("migrate")
    return spawn(migrate.run_all, WORLD, tmp, str(tmp))


def test_accelerate_logging_calls_work_as_there(ranks):
    logs = [res["logging"] for res in ranks]
    assert logs[0]["messages"] == [
        "***** Running training *****",
        f"[rank 0/{WORLD}] every rank",
        f"[rank 0/{WORLD}] in order",
        "once",
        f"[rank 0/{WORLD}] everyone's logger",
        "only the main one",
    ]
    assert logs[1]["messages"] == [
        f"[rank 1/{WORLD}] every rank",
        f"[rank 1/{WORLD}] in order",
        f"[rank 1/{WORLD}] everyone's logger",
    ]
    assert logs[0]["funcs"] == logs[1]["funcs"] == ["accelerate_logging"]  # the caller's line


def _needs_transformers(result):
    if result is None:
        pytest.skip("transformers is not installed (pip install transformers)")


def test_schedule_sized_by_accelerates_arithmetic_is_warned_about_once(ranks):
    kept = [res["schedule_kept"] for res in ranks]
    _needs_transformers(kept[0])
    assert [k["steps"] for k in kept] == [3, 3]
    (message,) = kept[0]["warnings"]  # once, on rank 0, naming the fix
    assert "planned for 6 steps, 2 times the 3 optimizer steps" in message
    assert "warmup of 2 steps" in message and "drop the `* num_processes`" in message
    assert kept[1]["warnings"] == []
    assert kept[0]["lr"] > 0  # the schedule ran W times too slowly: the decay never finished
    dropped = [res["schedule_dropped"] for res in ranks]
    assert [d["warnings"] for d in dropped] == [[], []]
    assert [d["lr"] for d in dropped] == [0.0, 0.0]  # as Accelerate ends it: decayed to 0


def test_schedule_length_is_not_checked_on_one_process():
    kept = migrate.hf_clm_schedule(keep_accelerate_arithmetic=True)  # x world_size == x 1
    _needs_transformers(kept)
    assert kept["warnings"] == [] and kept["lr"] == 0.0


def test_a_ddp_versions_checkpoint_says_what_it_is_and_how_to_load_it(ranks):
    for res in ranks:
        got = res["ddp_checkpoint"]
        assert got["refused_first"] == got["refused"]  # before the first forward and after it
        assert "saved from a DistributedDataParallel wrapper" in got["refused"]
        assert "consume_prefix_in_state_dict_if_present(state_dict, 'module.')" in got["refused"]
        assert got["loaded"]  # the fix the message names loads it
        assert got["hooks_after"] == 0  # nothing of ours left on the model after the scope


def test_fabric_all_gather_of_a_number_as_the_guide_maps_it(ranks):
    for res in ranks:
        assert res["fabric_gather"] == {"as_row": 0.75, "bare": [0.25, 0.5]}


def test_the_guides_recipe_gives_accelerates_order(ranks):
    for res in ranks:
        order = res["accelerate_order"]
        assert order["seen"] == order["expected"]


def test_the_ddp_guides_account_of_distributed_sampler_kept_and_dropped(ranks):
    for res in ranks:
        assert res["ddp_sampler"] == {"kept": True, "dropped": True, "differ": True}
