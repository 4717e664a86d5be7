"""What counts as an evaluation's results written to files (issue 52: per-rank prediction files
were told that nothing combined them): ``_data.file_writes``, in one process."""

from __future__ import annotations

import json
import logging
import sys

from accel_ctx._data import file_writes


def _now(held: set[str], *args) -> file_writes.Writes:
    """``file_writes.now()`` less the files ``held`` open before the test began: the test
    process also holds the terminal or log the suite was started with, saved by pytest's
    capture under a descriptor other than 1 and 2, which grows whenever the suite prints."""
    start = file_writes.now(*args)
    return file_writes.Writes(tuple(e for e in start.open_files if e[0] not in held))


def test_a_file_open_at_the_start_that_grows_counts_and_prints_logs_and_stores_do_not(tmp_path):
    held = {path for path, _ in file_writes.now().open_files}
    store = tmp_path / "store"
    handler = logging.FileHandler(tmp_path / "eval.log")
    logger = logging.getLogger("test_messages_file_writes")
    logger.addHandler(handler)
    metrics = tmp_path / "runs"
    metrics.mkdir()
    try:
        with open(store, "w") as store_file, open(metrics / "events", "w") as events:
            start = _now(held, str(store), [str(metrics)])
            print("Accuracy: 15/96")  # a report of this rank's share
            sys.stderr.write("a line\n")
            logger.warning("accuracy 0.25")
            handler.flush()
            store_file.write("rdzv/arrived 1")
            store_file.flush()
            events.write("an event")
            events.flush()
            assert not file_writes.wrote_files(start)
    finally:
        logger.removeHandler(handler)
        handler.close()

    with open(tmp_path / "preds-0.txt", "w") as f:  # opened before the loop, written in it
        start = _now(held)
        assert not file_writes.wrote_files(start)
        f.write("1\n0\n")
    assert file_writes.wrote_files(start)

    with open(tmp_path / "preds-0.json", "w") as f:  # written after the loop, before it closes
        start = _now(held)
        json.dump([0, 1, 1], f)
    assert file_writes.wrote_files(start)

    with open(tmp_path / "preds-0.txt") as f:  # a file read is no file written
        start = _now(held)
        f.read()
    assert not file_writes.wrote_files(start)
