"""Scripts moved from Accelerate keep working: its logging calls, its scheduler arithmetic."""

from __future__ import annotations

import pytest

from .._spawn import spawn
from ..workers import migrate

WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn(migrate.run_all, WORLD, tmp_path_factory.mktemp("migrate"))


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
