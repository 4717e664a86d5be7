"""Process control on real processes: code runs on exactly the ranks it names; ranks meet."""

from __future__ import annotations

import asyncio
import inspect
import io
import logging
import warnings
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from accel_ctx import (
    distributed,
    get_logger,
    main_print,
    main_process_first,
    on_last_process,
    on_local_main_process,
    on_main_process,
    on_process,
    wait_for_everyone,
)
from accel_ctx.errors import ConfigurationError

from .._spawn import rank_env, spawn
from ..workers import process

# world size -> processes per machine: world 3 runs as two "machines" of 2 and 1 processes
LOCAL_WORLD = {1: 1, 2: 1, 3: 2}


@pytest.fixture(scope="module", params=[1, 2, 3], ids=["world1", "world2", "world3"])
def ranks(request, tmp_path_factory):
    world = request.param
    tmp = tmp_path_factory.mktemp(f"process{world}")
    local_world = LOCAL_WORLD[world]

    def env(rank: int) -> dict[str, str]:
        return rank_env(rank, world, tmp, LOCAL_RANK=str(rank % local_world),
                        LOCAL_WORLD_SIZE=str(local_world))

    return world, spawn(process.run_all, world, tmp, str(tmp / "shared"), env=env)


def _named(world: int) -> dict[str, set[int]]:
    local_world = LOCAL_WORLD[world]
    return {
        "main": {0},
        "main()": {0},
        "async": {0},
        "method": {0},
        "local": {r for r in range(world) if r % local_world == 0},
        "last": {world - 1},
        "one": {1} & set(range(world)),
        "five": set(),
    }


def test_each_decorator_runs_on_exactly_the_ranks_it_names(ranks):
    world, results = ranks
    for name, expected in _named(world).items():
        ran = {r for r, res in enumerate(results) if res["decorators"]["calls"].get(name)}
        assert ran == expected, f"{name}: ran on {sorted(ran)}, expected {sorted(expected)}"
        for r in expected:
            assert results[r]["decorators"]["calls"][name] == 3  # every call, not just the first
    returns = [res["decorators"]["returns"] for res in results]
    assert returns[0]["main"] == [0, 2, 4]
    assert returns[0]["async"] == ["async"] * 3
    for r in range(1, world):
        assert returns[r]["main"] == [None] * 3  # other ranks get None
        assert returns[r]["async"] == [None] * 3
    assert results[0]["decorators"]["saved"] == [0, 1, 2]
    assert all(res["decorators"]["saved"] == [] for res in results[1:])


def test_with_form_says_which_ranks_act(ranks):
    world, results = ranks
    named = _named(world)
    for name in ("main", "last", "one", "local"):
        acting = {r for r, res in enumerate(results) if res["decorators"]["with"][name]}
        assert acting == named[name]


def test_rank_is_read_when_called_not_when_decorated(ranks):
    _, results = ranks
    # decorated at import time, before any scope; outside the scope every process is rank 0
    assert all(res["decorators"]["outside_calls"] == {"main": 1} for res in results)


def test_missing_rank_warns_once_on_rank_zero(ranks):
    _, results = ranks
    warned = [
        [w for w in res["decorators"]["warnings"] if "rank_five_only" in w[0]] for res in results
    ]
    assert len(warned[0]) == 1 and "names rank 5" in warned[0][0][0]
    assert warned[0][0][1] == "process.py"  # points at the caller's line
    assert all(w == [] for w in warned[1:])


def test_main_process_goes_first_and_barriers_wait(ranks):
    world, results = ranks
    assert results[0]["meeting"]["entered_first"]
    for res in results[1:]:
        assert res["meeting"]["found_prepared"]
        assert res["meeting"]["late_seen_after_wait"]
    local_world = LOCAL_WORLD[world]
    for r, res in enumerate(results):
        if r % local_world:  # not first on its machine: its machine's first process went first
            assert res["meeting"]["found_node_marker"]


def test_main_print_prints_once(ranks):
    _, results = ranks
    assert results[0]["meeting"]["printed"] == "hello-0\n"
    assert all(res["meeting"]["printed"] == "" for res in results[1:])


def test_logger_logs_on_main_only_unless_all_ranks(ranks):
    world, results = ranks
    logs = [res["meeting"]["logs"] for res in results]
    prefix = f"[rank 0/{world}] " if world > 1 else ""
    assert logs[0]["messages"] == ["main only 1", f"{prefix}from every rank"]
    assert logs[0]["funcs"] == ["_logs", "_logs"]  # records point at the caller
    for r in range(1, world):
        assert logs[r]["messages"] == [f"[rank {r}/{world}] from every rank"]
        assert logs[r]["ranks"] == [r]


# ---- single process, in this process ------------------------------------------------------------
def test_decorators_keep_name_signature_and_doc():
    def save(path: str, *, overwrite: bool = False) -> str:
        """Save things."""
        return path

    for decorate in (on_main_process, on_main_process(), on_local_main_process,
                     on_last_process, on_process(0)):
        wrapped = decorate(save)
        assert wrapped.__name__ == "save" and wrapped.__doc__ == "Save things."
        assert inspect.signature(wrapped) == inspect.signature(save)
        assert wrapped("p", overwrite=True) == "p"


def test_misuse_is_refused_with_the_fix():
    with pytest.raises(ConfigurationError, match=r"@on_process\(1\)"):
        on_process(lambda: None)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="rank >= 0"):
        on_process(-1)
    with pytest.raises(TypeError, match="generator function"):
        @on_main_process
        def stream():
            yield 1
    with pytest.raises(TypeError, match="not the class"):
        on_main_process()(int)
    with pytest.raises(TypeError, match="takes no arguments"):
        on_main_process(3)  # type: ignore[call-overload]


def test_single_process_runs_everything_and_meeting_points_return_at_once():
    ran = []

    @on_process(0)
    def work() -> int:
        ran.append(1)
        return 7

    with distributed():
        assert work() == 7
        wait_for_everyone()
        with main_process_first(), on_main_process() as here:
            assert here
        buffer = io.StringIO()
        with redirect_stdout(buffer):
            main_print("a", "b")
        assert buffer.getvalue() == "a b\n"
        writes: list[str] = []  # one write per line: groups sharing a stream never splice lines

        class Stream:
            def write(self, text: str) -> int:
                writes.append(text)
                return len(text)

            def flush(self) -> None: ...

        main_print("done", 4, sep=": ", end=None, file=Stream())
        main_print("x", "y", sep=None, file=Stream())
        assert [w for w in writes if w] == ["done: 4\n", "x y\n"]
    assert work() == 7 and ran == [1, 1]
    wait_for_everyone()  # outside any scope too


def test_single_process_failure_is_an_ordinary_exception():
    @on_main_process
    def boom() -> None:
        raise ValueError("disk full")

    with pytest.raises(ValueError, match="disk full"), distributed():
        boom()
    with pytest.raises(KeyError), main_process_first():
        raise KeyError("x")


def test_main_process_first_as_decorator():
    @main_process_first()
    def build() -> list[int]:
        return [1, 2]

    with distributed():
        assert build() == [1, 2]


def test_async_function_on_other_ranks_is_awaitable(monkeypatch):
    @on_process(3)
    async def fetch() -> str:
        return "x"

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # rank 0 of 1 is not rank 3, but the call still gives something to await
        assert asyncio.run(fetch()) is None


def test_logger_is_standard_logging(caplog):
    log = get_logger("accel_ctx_single")
    assert isinstance(log, logging.LoggerAdapter)
    with caplog.at_level(logging.INFO, logger="accel_ctx_single"):
        log.info("one %s", "process")
    assert [r.getMessage() for r in caplog.records] == ["one process"]
    assert caplog.records[0].rank == 0 and caplog.records[0].world_size == 1
    assert Path(caplog.records[0].pathname).name == "test_process.py"
