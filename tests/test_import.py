"""`import accel_ctx` stays cheap: the checkpoint and launcher wings load on first use."""

from __future__ import annotations

import subprocess
import sys

import accel_ctx


def test_every_public_name_resolves_under_the_public_module():
    for name in accel_ctx.__all__:
        value = getattr(accel_ctx, name)
        if name != "errors":
            assert value.__module__ == "accel_ctx", name


def test_importing_leaves_the_checkpoint_and_launcher_wings_unloaded():
    code = (
        "import sys, accel_ctx\n"
        "wings = [m for m in sys.modules if m.startswith(('accel_ctx._checkpoint', "
        "'accel_ctx._launch'))]\n"
        "assert not wings, wings\n"
        "from accel_ctx import save_state, launch\n"
        "assert 'accel_ctx._checkpoint' in sys.modules and 'accel_ctx._launch' in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
