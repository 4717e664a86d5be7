"""A replica group's worker marks in its launcher's folder (``ACCEL_CTX_REPLICA_MARKS``) that its
group's runtime opened: one empty file per rank, whole at once, and nothing raised where the
launcher removed the folder (it is ending)."""

from __future__ import annotations

from pathlib import Path

import pytest

from accel_ctx._engines.replica_client import mark_joined


def test_each_rank_marks_once_in_the_launchers_folder_and_a_gone_folder_is_ignored(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_CTX_REPLICA_MARKS", str(tmp_path))
    mark_joined(0)
    mark_joined(3)
    mark_joined(3)  # a restarted worker marks again: the same file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["joined-0", "joined-3"]
    assert (tmp_path / "joined-3").read_bytes() == b""
    monkeypatch.setenv("ACCEL_CTX_REPLICA_MARKS", str(tmp_path / "gone"))
    mark_joined(1)  # no error: nobody reads it
    monkeypatch.delenv("ACCEL_CTX_REPLICA_MARKS")
    mark_joined(2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["joined-0", "joined-3"]
