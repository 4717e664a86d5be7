"""Checks run inside each spawned rank for scripts moved from Accelerate, DDP and Fabric."""

from __future__ import annotations

import logging
from typing import Any

from accel_ctx import distributed, get_logger


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def accelerate_logging() -> dict[str, Any]:
    """The logging lines of an Accelerate script (run_clm_no_trainer.py's and its kin's)."""
    handler = _ListHandler()
    base = logging.getLogger("migrated_from_accelerate")
    base.addHandler(handler)
    base.propagate = False
    try:
        with distributed():
            logger = get_logger("migrated_from_accelerate", log_level="INFO")
            logger.info("***** Running training *****")
            logger.info("every rank", main_process_only=False)
            logger.info("in order", main_process_only=False, in_order=True)
            logger.warning_once("once")
            logger.warning_once("once")
            everyone = get_logger("migrated_from_accelerate", main_process_only=False)
            everyone.debug("below the level")
            everyone.warning("everyone's logger")
            everyone.info("only the main one", main_process_only=True)
        return {
            "messages": [r.getMessage() for r in handler.records],
            "funcs": sorted({r.funcName for r in handler.records}),
        }
    finally:
        base.removeHandler(handler)


def run_all() -> dict[str, Any]:
    return {"logging": accelerate_logging()}
