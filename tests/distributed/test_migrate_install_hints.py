"""The install commands our replica-group errors name work for a user who installed as documented.

accel_ctx has no release on PyPI (README: install from a clone or a wheel built there), so a hint
must name torchft itself, at the version the ft extra asks, or the extra from the clone.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from accel_ctx._engines import replica_client
from accel_ctx._launch import lighthouse, replica_groups
from accel_ctx._launch.settings import SETTINGS

ROOT = Path(__file__).resolve().parents[2]


def _ft_extra() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["ft"]


@pytest.mark.parametrize("message", [
    replica_groups._NO_TORCHFT, lighthouse._NO_TORCHFT, replica_client._NO_TORCHFT,
], ids=["launch", "lighthouse", "worker"])
def test_a_missing_torchft_names_an_install_that_works_without_pypi_release(message):
    (requirement,) = _ft_extra()
    assert f"pip install '{requirement}'" in message  # torchft itself, from PyPI
    assert "pip install -e '.[ft]'" in message  # or the extra, in the clone


def test_the_launcher_help_names_torchft_not_only_the_extra():
    for s in SETTINGS:
        if "[ft]" in s.help:
            pytest.fail(f"{s.flags}: {s.help!r} names accel-ctx[ft], which pip cannot find "
                        "on PyPI: name torchft")
    assert sum("Needs torchft" in s.help for s in SETTINGS) == 2
