"""The README's lists of state() fields and of each scope's options name exactly what the code
has: a field or an option added, renamed or removed fails here until the README says so."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import accel_ctx
from accel_ctx import DistributedOptions, State

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def _table_after(heading: str) -> set[str]:
    """The option names in the first column of the table that follows ``heading``."""
    start = README.index(heading)
    names = []
    for line in README[start:].splitlines()[1:]:
        if line.startswith("| `"):
            names.append(line.split("`")[1])
        elif names and not line.startswith("|"):
            break
    return set(names)


def test_the_state_field_list_names_every_field_and_property():
    sentence = README[README.index("`state()` tells where"):]
    sentence = sentence[:sentence.index("Outside any scope")]
    listed = set(re.findall(r"`(\w+)`", sentence)) - {"state"}
    fields = {f.name for f in dataclasses.fields(State) if not f.name.startswith("_")}
    properties = {n for n, v in vars(State).items() if isinstance(v, property)}
    assert listed == fields | properties


def test_the_options_tables_name_every_option():
    assert _table_after("`distributed(**options)` (also") == {  # `given` is no option
        f.name for f in dataclasses.fields(DistributedOptions)} - {"given"}
    precision = set(inspect.signature(accel_ctx.mixed_precision).parameters) - {"policy"}
    assert _table_after("`mixed_precision(policy, **options)`") == precision
    sharded = set(inspect.signature(accel_ctx.sharded).parameters) - {"options"}
    assert _table_after("`sharded(**options)`, besides") == sharded
    assert list(inspect.signature(accel_ctx.accumulate).parameters) == ["steps"]
    assert not inspect.signature(accel_ctx.no_sync).parameters
