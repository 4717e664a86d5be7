"""Messages that say what happened (issue 52): a user's mistake is named with its fix, and a
correct script is told nothing."""

from __future__ import annotations

import pytest

from accel_ctx import distributed, log_metrics
from accel_ctx.errors import ConfigurationError


@pytest.mark.parametrize("under", ["file", "below_a_file"])
def test_log_metrics_into_a_file_names_the_file_and_the_folder_to_give(tmp_path, under):
    # A user's slip: the CSV file's own name given as the folder (or a folder under a file).
    (tmp_path / "metrics.csv").write_text("step,name,value,time\n")
    directory = tmp_path / "metrics.csv" / ("run1" if under == "below_a_file" else "")
    with distributed(), pytest.raises(ConfigurationError) as raised:
        log_metrics({"loss": 0.5}, step=1, directory=directory)
    message = str(raised.value)
    assert f"{str(tmp_path / 'metrics.csv')!r} is a file, not a folder" in message, message
    assert f"directory={str(tmp_path)!r}" in message, message
    assert isinstance(raised.value, ValueError)


def test_log_metrics_into_a_file_named_by_the_environment_says_so(tmp_path, monkeypatch):
    (tmp_path / "runs").write_text("")
    monkeypatch.setenv("ACCEL_CTX_METRICS_DIR", str(tmp_path / "runs"))
    with pytest.raises(ConfigurationError, match=r"\$ACCEL_CTX_METRICS_DIR.*is a file"):
        log_metrics({"loss": 0.5}, step=1)


@pytest.mark.spawns
def test_an_inference_that_writes_each_ranks_predictions_to_files_is_told_nothing(tmp_path):
    # issue 52: a sharded inference writing per-rank files was told nothing combined its results
    from .._spawn import spawn
    from ..workers import messages

    ranks = spawn(messages.evaluation_outputs, 2, tmp_path, str(tmp_path))
    files = sorted(f"preds-{r}.{kind}" for kind in ("json", "pt", "txt") for r in (0, 1))
    assert ranks[0]["files"] == files
    assert ranks[0]["json"] == [] and ranks[0]["open_file"] == [] and ranks[0]["torch_save"] == []
    # an evaluation that counts its share is still told, also when it prints and logs them
    assert len(ranks[0]["counts_its_share"]) == 2, ranks[0]["counts_its_share"]  # a loader each
    assert all("nothing combined its results" in w for w in ranks[0]["counts_its_share"])
    assert all(not rank[case] for rank in ranks[1:] for case in messages.CASES)  # rank 0 only
