"""A Griffe extension for the API reference: the docstrings' Sphinx roles read as Markdown.

The docstrings name other objects as Sphinx does (``:func:`gather```,
``:class:`~accel_ctx.errors.DistributedError```), which Markdown would show as typed. Here a
role whose target the API page documents becomes a link to it, and any other (a private
helper, torch's classes) plain code. The docstrings themselves stay as they are.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from griffe import Extension, Object

_ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|exc|obj):`(~?)\.?([\w.]+?)(\(\))?`")


def _documented() -> set[str]:
    """The identifiers the API page renders: every public name, and the errors."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the clone's accel_ctx
    import accel_ctx
    from accel_ctx import errors

    names = {f"accel_ctx.{n}" for n in accel_ctx.__all__}
    return names | {f"accel_ctx.errors.{n}" for n in dir(errors) if not n.startswith("_")}


class SphinxRoles(Extension):
    """Rewrite the roles of every docstring as it is loaded."""

    def __init__(self) -> None:
        super().__init__()
        self.documented = _documented()

    def on_object(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(self._markdown, obj.docstring.value)

    def _markdown(self, role: re.Match[str]) -> str:
        short, target, call = role.group(1) == "~", role.group(2), role.group(3) or ""
        text = f"`{target.rsplit('.', 1)[-1] if short else target}{call}`"
        for identifier in (target, f"accel_ctx.{target}", f"accel_ctx.errors.{target}"):
            if identifier in self.documented:
                return f"[{text}][{identifier}]"
        return text
