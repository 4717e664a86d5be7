"""Process-control checks run inside each spawned rank: decorators, meeting points, output."""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

from accel_ctx import (
    distributed,
    get_logger,
    main_print,
    main_process_first,
    on_last_process,
    on_local_main_process,
    on_main_process,
    on_process,
    state,
    wait_for_everyone,
)

from .common import ListHandler

# Decorated at import, in every process, before any scope exists: the rank must be read at
# each call, not here.
CALLS: Counter[str] = Counter()


@on_main_process
def main_only(x: int) -> int:
    CALLS["main"] += 1
    return x * 2


@on_main_process()
def main_only_called_form() -> str:
    CALLS["main()"] += 1
    return "main"


@on_local_main_process
def local_main_only() -> str:
    CALLS["local"] += 1
    return "local"


@on_last_process
def last_only() -> str:
    CALLS["last"] += 1
    return "last"


@on_process(1)
def rank_one_only() -> str:
    CALLS["one"] += 1
    return "one"


@on_process(5)
def rank_five_only() -> None:
    CALLS["five"] += 1


@on_main_process
async def main_only_async() -> str:
    CALLS["async"] += 1
    return "async"


class Checkpointer:
    def __init__(self) -> None:
        self.saved: list[int] = []

    @on_main_process
    def save(self, step: int) -> int:
        CALLS["method"] += 1
        self.saved.append(step)
        return step


def decorators() -> dict[str, Any]:
    CALLS.clear()
    out: dict[str, Any] = {}
    returns: dict[str, list[Any]] = {}
    with distributed():
        ckpt = Checkpointer()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(3):
                returns.setdefault("main", []).append(main_only(step))
                returns.setdefault("main()", []).append(main_only_called_form())
                returns.setdefault("local", []).append(local_main_only())
                returns.setdefault("last", []).append(last_only())
                returns.setdefault("one", []).append(rank_one_only())
                returns.setdefault("five", []).append(rank_five_only())
                returns.setdefault("async", []).append(asyncio.run(main_only_async()))
                returns.setdefault("method", []).append(ckpt.save(step))
        out["warnings"] = [(str(w.message), Path(w.filename).name) for w in caught]
        with on_main_process() as here_main, on_last_process() as here_last:
            out["with"] = {"main": here_main, "last": here_last}
        with on_process(1) as here_one, on_local_main_process() as here_local:
            out["with"].update(one=here_one, local=here_local)
        out["saved"] = ckpt.saved
        out["state"] = (state().rank, state().local_rank, state().world_size)
    out["calls"] = dict(CALLS)
    out["returns"] = returns
    CALLS.clear()
    main_only(1)  # outside the scope every process is rank 0 of 1: it runs everywhere
    out["outside_calls"] = dict(CALLS)
    return out


def meeting_points(tmp_dir: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    tmp = Path(tmp_dir)
    with distributed():
        rank = state().rank
        # main_process_first: the main process prepares, the others find it prepared
        with main_process_first():
            prepared = tmp / "prepared.txt"
            if rank == 0:
                time.sleep(0.5)
                prepared.write_text("data")
                out["entered_first"] = True
            else:
                out["found_prepared"] = prepared.exists()
        # local=True: the first process of each machine goes first
        with main_process_first(local=True):
            marker = tmp / f"node{state().node_rank}.txt"
            if state().is_local_main_process:
                time.sleep(0.5)
                marker.write_text("x")
            else:
                out["found_node_marker"] = marker.exists()
        # wait_for_everyone: nobody passes before the slow rank arrives
        if rank == 0:
            time.sleep(0.5)
            (tmp / "late.txt").write_text("x")
        wait_for_everyone()
        out["late_seen_after_wait"] = (tmp / "late.txt").exists()
        for _ in range(20):  # many barriers in a row stay in step
            wait_for_everyone()
        # rank-0 print
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            main_print("hello", rank, sep="-")
        out["printed"] = buffer.getvalue()
        out["logs"] = _logs()
    return out


def _logs() -> dict[str, Any]:
    handler = ListHandler()
    base = logging.getLogger("accel_ctx_test_worker")
    base.addHandler(handler)
    base.propagate = False
    try:
        log = get_logger("accel_ctx_test_worker", level="INFO")
        log.info("main only %d", 1)
        log.debug("below the level")
        everyone = get_logger("accel_ctx_test_worker", all_ranks=True)
        everyone.warning("from every rank")
        return {
            "messages": [r.getMessage() for r in handler.records],
            "ranks": [getattr(r, "rank", None) for r in handler.records],
            "funcs": [r.funcName for r in handler.records],
        }
    finally:
        base.removeHandler(handler)


def run_all(tmp_dir: str) -> dict[str, Any]:
    os.makedirs(tmp_dir, exist_ok=True)
    return {"decorators": decorators(), "meeting": meeting_points(tmp_dir)}
