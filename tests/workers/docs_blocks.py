"""Code blocks of the documentation, run on real ranks."""

from __future__ import annotations

from typing import Any


def run_block(code: str, where: str, result: str) -> Any:
    """Run one block as a script (``__main__``) and return the value it left in ``result``."""
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(code, where, "exec"), namespace)
    return namespace[result]
