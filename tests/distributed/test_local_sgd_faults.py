"""local_sgd() misused on 2 real ranks (accel-ctx launch -n 2, gloo): each mistake ends at once,
on every rank, with an error naming the cause, the rank that is off and the fix, where it used to
end with the ranks apart and exit code 0, or hang 600 s in the next collective."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .. import _launcher

pytestmark = pytest.mark.usefixtures("_stop_launchers")


def test_local_sgd_alone_and_ranks_at_different_steps_end_at_once_naming_the_rank(
        tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    script = str(_launcher.SCRIPTS / "local_sgd_misuse.py")
    proc, log = _launcher.start(["-n", "2", script, str(out)], tmp_path, "misuse.log")
    assert _launcher.finish(proc, 180) == 0, log.read_text(errors="replace")[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, runs in enumerate(ranks):
        # no distributed(): refused at the first forward, naming the fix
        alone = runs["alone"]
        assert alone["type"] == "ConfigurationError" and alone["at"] == 1, alone
        assert "without distributed(), in a job of 2 processes" in alone["message"]
        assert "`with distributed(), local_sgd(every=3):`" in alone["message"]
        # rank 1 skipped the step of batch 2: its first sync comes at batch 4, rank 0's at 3
        skipped = runs["skipped_step"]
        assert skipped["type"] == "DistributedError", skipped
        assert skipped["at"] == (3 if rank == 0 else 4), skipped
        assert ("at the 1st synchronisation: rank 1 took 1 optimizer step fewer than rank 0 "
                "(3 steps in 4 backward passes; rank 0: 3 in 3)") in skipped["message"]
        # rank 1 skipped batch 2 altogether: 6 steps against 7, told at the scope's exit
        short = runs["skipped_batch"]
        assert short["type"] == "DistributedError" and short["at"] == 0, short
        assert ("at the end of the scope: rank 1 took 1 optimizer step fewer than rank 0 "
                "(6 steps in 6 backward passes; rank 0: 7 in 7)") in short["message"]
        for name in ("skipped_step", "skipped_batch"):
            assert runs[name]["seconds"] < 60, runs[name]  # not the collective's timeout
