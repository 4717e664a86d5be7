"""What counts as an evaluation's results written to files (issue 52: per-rank prediction files
were told that nothing combined them): the signals of ``_data.file_writes``, in one process."""

from __future__ import annotations

import json
import logging
import sys

from accel_ctx import log_metrics
from accel_ctx._data import file_writes


def test_files_opened_for_writing_or_growing_count_and_prints_logs_and_our_files_do_not(
        tmp_path):
    start = file_writes.now()
    print("Accuracy: 15/96")  # a report of this rank's share
    sys.stderr.write("a line\n")
    log_metrics({"accuracy": 0.25}, step=0, directory=tmp_path / "runs")  # accel_ctx's own
    handler = logging.FileHandler(tmp_path / "eval.log")
    logger = logging.getLogger("test_messages_file_writes")
    logger.addHandler(handler)
    try:
        logger.warning("accuracy 0.25")
        open(tmp_path / "notes.txt").close() if (tmp_path / "notes.txt").exists() else None
        assert not file_writes.wrote_files(start)
        # a logging file open at the start grows: still no result
        again = file_writes.now()
        logger.warning("accuracy 0.5")
        handler.flush()
        assert not file_writes.wrote_files(again)
    finally:
        logger.removeHandler(handler)
        handler.close()

    start = file_writes.now()
    (tmp_path / "preds-0.json").write_text(json.dumps([0, 1, 1]))  # written after the loop
    assert file_writes.wrote_files(start)

    with open(tmp_path / "preds-0.txt", "w") as f:  # opened before the loop, written in it
        start = file_writes.now()
        assert not file_writes.wrote_files(start)
        f.write("1\n0\n")
    assert file_writes.wrote_files(start)

    start = file_writes.now()
    with open(tmp_path / "preds-0.txt") as f:  # reading is no writing
        f.read()
    assert not file_writes.wrote_files(start)
