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
