"""`import accel_ctx` stays cheap: the checkpoint and launcher wings load on first use."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest

import accel_ctx

from .._timeouts import scaled


def test_every_public_name_resolves_under_the_public_module():
    for name in accel_ctx.__all__:
        value = getattr(accel_ctx, name)
        if name != "errors":
            assert value.__module__ == "accel_ctx", name


# The import-state checks share two fresh interpreters (each costs a torch import), not one
# each: the steps run in the order that keeps each check's premise (no torch before the
# package's first name, no wing before its first name). The commands' checks need one of their
# own: the CLI loads the launcher wing before any torch, the package's checks the reverse.
_PACKAGE = """
import json, sys
seen = {}
import accel_ctx
seen['torch_at_import'] = 'torch' in sys.modules  # importing the package loads nothing heavy
accel_ctx.state
seen['torch_at_first_name'] = 'torch' in sys.modules  # a name loads its module on first use
from accel_ctx import distributed, sharded, mixed_precision, accumulate, no_sync
import accel_ctx._engines.choice, accel_ctx._engines.tensor_parallel
seen['dtensor'] = [m for m in sys.modules if m.startswith('torch.distributed.tensor')][:3]
seen['wings'] = [m for m in sys.modules
                 if m.startswith(('accel_ctx._checkpoint', 'accel_ctx._launch'))]
from accel_ctx import save_state, launch
seen['wings_after'] = ['accel_ctx._checkpoint' in sys.modules, 'accel_ctx._launch' in sys.modules]
print(json.dumps(seen))
"""
_COMMANDS = """
import contextlib, io, json, sys
from accel_ctx.cli import main
seen = []
for argv in (['--help'], ['launch', '--help'], ['launch', '-n', '2', '--help'],
             ['config', '--show'], ['env', '--help']):
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    seen.append([argv, code, 'torch' in sys.modules])
print(json.dumps(seen))
"""


def _fresh_interpreter(code: str, home: Path) -> Any:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=scaled(120), cwd=home, env={**os.environ, "HOME": str(home)})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def package_imports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return cast(dict[str, Any], _fresh_interpreter(_PACKAGE, tmp_path_factory.mktemp("home")))


def test_importing_leaves_the_checkpoint_and_launcher_wings_unloaded(package_imports):
    assert package_imports["wings"] == []
    assert package_imports["wings_after"] == [True, True]


def test_importing_the_scopes_loads_no_dtensor_code(package_imports):
    """torch.distributed.tensor (about a second) loads only once a tensor plan is used."""
    assert package_imports["dtensor"] == []


def test_the_commands_help_and_config_import_no_torch(tmp_path, package_imports):
    for argv, code, torch_loaded in _fresh_interpreter(_COMMANDS, tmp_path):
        assert code == 0 and not torch_loaded, argv
    assert not package_imports["torch_at_import"]
    assert package_imports["torch_at_first_name"]


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


def test_a_class_find_of_another_folders_runtime_breaks_a_contract(tmp_path):
    """`stack.find(AccumulateRuntime)` from the checkpoints, or the replica groups' runtime
    imported by the data layer, is what the by-capability contracts exist to refuse."""
    import shutil

    root = Path(accel_ctx.__file__).parent
    shutil.copytree(root, tmp_path / "accel_ctx", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(root.parent / "pyproject.toml", tmp_path)
    for module, line in (
            ("_checkpoint/heal.py", "from .._steps.accumulation import AccumulateRuntime"),
            ("_data/order.py", "from .._engines import fault_tolerant")):
        path = tmp_path / "accel_ctx" / module
        path.write_text(path.read_text() + f"\n{line}  # noqa\n")
    linter = Path(sys.executable).parent / "lint-imports"
    done = subprocess.run(
        [str(linter if linter.exists() else "lint-imports"), "--no-cache"], cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True, text=True,
        timeout=scaled(120))
    said = " ".join((done.stdout + done.stderr).split())
    assert done.returncode != 0, said
    # the checkpoints' own contract sees the first too; nothing else breaks
    assert "9 kept, 3 broken" in said, said
    for contract in ("accumulate()'s and no_sync()'s runtimes are asked by capability, never by "
                     "their class BROKEN", "The replica groups' runtime is asked by capability, "
                     "never by its class BROKEN"):
        assert contract in said, said
    assert "accel_ctx._checkpoint.heal -> accel_ctx._steps.accumulation" in said
    assert "accel_ctx._data.order -> accel_ctx._engines.fault_tolerant" in said
