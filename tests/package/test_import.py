"""`import accel_ctx` stays cheap: the checkpoint and launcher wings load on first use."""

from __future__ import annotations

import subprocess
import sys

import accel_ctx

from .._timeouts import scaled


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


def test_importing_the_scopes_loads_no_dtensor_code():
    """torch.distributed.tensor (about a second) loads only once a tensor plan is used."""
    code = (
        "import sys, accel_ctx\n"
        "from accel_ctx import distributed, sharded, mixed_precision, accumulate, no_sync\n"
        "accel_ctx.state\n"
        "import accel_ctx._engines.choice, accel_ctx._engines.tensor_parallel\n"
        "loaded = [m for m in sys.modules if m.startswith('torch.distributed.tensor')]\n"
        "assert not loaded, loaded[:3]\n"
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


def test_every_module_has_its_place_in_the_layers_contract():
    """The folders are the layers (pyproject.toml): a new folder or root module must be given a
    layer, or nothing checks what it may import. The house's other rules are held here too: no module
    over 350 lines, a handful of modules at the package root, small ``:`` groups."""
    from pathlib import Path

    import tomllib

    root = Path(accel_ctx.__file__).parent
    config = tomllib.loads((root.parent / "pyproject.toml").read_text())
    [layers] = [c for c in config["tool"]["importlinter"]["contracts"] if c["id"] == "layers"]
    listed: set[str] = set()
    for layer in layers["layers"]:
        names = [n.strip() for n in layer.replace(":", "|").split("|")]
        assert layer.count(":") < 6, f"a ':' layer of more than 6 names: {layer}"
        listed.update(names)
    modules = {".".join(p.relative_to(root).with_suffix("").parts)
               for p in root.rglob("*.py") if p.name != "__init__.py"}
    unplaced = sorted(m for m in modules if not any(
        m == name or m.startswith(name + ".") for name in listed))
    assert not unplaced, f"modules with no layer in pyproject.toml: {unplaced}"
    at_root = sorted(m for m in modules if "." not in m)
    assert len(at_root) <= 6, at_root
    long = {m: n for m in modules
            if (n := len((root / (m.replace(".", "/") + ".py")).read_text().splitlines())) > 350}
    assert not long, f"modules over 350 lines: {long}"


def test_an_older_torch_fails_the_import_naming_the_floor(tmp_path):
    """A torch below the floor is refused at `import accel_ctx`, read from its metadata (no torch
    import), not met later as an AttributeError deep inside a scope."""
    dist = tmp_path / "torch-2.10.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.10.0+cu128\n")
    code = (
        "import sys\n"
        "try:\n"
        "    import accel_ctx\n"
        "except ImportError as e:\n"
        "    assert type(e).__name__ == 'UnsupportedTorchError', type(e)\n"
        "    assert 'torch' not in sys.modules\n"
        "    print(e)\n"
        "else:\n"
        "    raise SystemExit('imported on torch 2.10')\n"
    )
    import os

    path = os.pathsep.join([str(tmp_path), *sys.path])  # the fake torch found first
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=scaled(120), env={**os.environ, "PYTHONPATH": path})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "accel_ctx needs torch 2.11 or newer; this environment has torch 2.10.0+cu128" \
        in result.stdout, result.stdout


def test_the_import_floor_is_the_one_pyproject_claims():
    from pathlib import Path

    import tomllib

    from accel_ctx import _TORCH_FLOOR

    root = Path(accel_ctx.__file__).parent.parent
    dependencies = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    [torch] = [d for d in dependencies if d.startswith("torch")]
    floor = ".".join(map(str, _TORCH_FLOOR))
    assert torch == f"torch>={floor}", torch
    ci = (root / ".ci" / "run").read_text()
    assert f"./dev compat {floor}.0\n" in ci, "CI runs the compat tier on the floor"
