"""`import accel_ctx` stays cheap: the checkpoint and launcher wings load on first use."""

from __future__ import annotations

import subprocess
import sys

import accel_ctx

from ._timeouts import scaled


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
                            timeout=scaled(120))
    assert result.returncode == 0, result.stderr


def test_the_commands_help_and_config_import_no_torch(tmp_path):
    code = (
        "import sys, contextlib, io\n"
        "from accel_ctx.cli import main\n"
        "for argv in (['--help'], ['launch', '--help'], ['launch', '-n', '2', '--help'],\n"
        "             ['config', '--show'], ['env', '--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        assert main(argv) == 0, argv\n"
        "    assert 'torch' not in sys.modules, argv\n"
        "import accel_ctx\n"
        "assert 'torch' not in sys.modules  # importing the package loads nothing heavy\n"
        "accel_ctx.state\n"
        "assert 'torch' in sys.modules  # a name loads its module on first use\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=scaled(120), cwd=tmp_path, env={**__import__("os").environ,
                                                            "HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr
