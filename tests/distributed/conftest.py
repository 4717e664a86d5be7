"""What the launcher tests of this folder share."""

import pytest

from .. import _launcher


@pytest.fixture
def _stop_launchers():
    """Whatever a test left running (it failed early) is stopped with its workers."""
    yield
    _launcher.stop_all()
