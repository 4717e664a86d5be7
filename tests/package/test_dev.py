"""`./dev demo` and `./dev test` install the package only when pyproject.toml changed.

`pip install -e` takes ~40 s even when nothing changed. The script runs here on a copy of the
clone, in an environment whose tools only record that they were called (pip, the launcher, the
checks): what is checked is which runs install.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from .._timeouts import scaled

ROOT = Path(__file__).resolve().parents[2]

PYTHON = f"""#!/usr/bin/env bash
log="$(dirname "$0")/../calls.log"
case "$*" in
  *"-m pip install"*) echo "pip install ${{*: -2:1}}" >> "$log"
                      printf '#!/bin/sh\\necho launch >> "%s"\\n' "$log" > "$(dirname "$0")/accel-ctx"
                      chmod +x "$(dirname "$0")/accel-ctx"; exit 0 ;;
  *"-m pytest"*) echo pytest >> "$log"; exit 0 ;;
  *"__version__"*) echo 2.13.0; exit 0 ;;
  *"device_count"*) echo 0; exit 0 ;;
  *"import torch"*) exit 0 ;;
esac
exec {sys.executable} "$@"
"""


def _environment(where: Path) -> Path:
    bin_ = where / "bin"
    bin_.mkdir(parents=True)
    (bin_ / "python").write_text(PYTHON)
    (bin_ / "activate").write_text(f'export PATH="{bin_}:$PATH"\n')
    for tool in ("mypy", "ruff", "lint-imports", "mkdocs"):
        (bin_ / tool).write_text("#!/bin/sh\nexit 0\n")
    for path in bin_.iterdir():
        path.chmod(0o755)
    return where


def _without_reinstall() -> dict[str, str]:
    # The caller's own ACCEL_CTX_REINSTALL (e.g. `ACCEL_CTX_REINSTALL=1 ./dev test`) would
    # force every install this test counts.
    return {k: v for k, v in os.environ.items() if k != "ACCEL_CTX_REINSTALL"}


def test_the_package_is_installed_again_only_when_pyproject_changed(tmp_path):
    clone = tmp_path / "clone"
    clone.mkdir()
    shutil.copy(ROOT / "dev", clone / "dev")
    shutil.copy(ROOT / "pyproject.toml", clone / "pyproject.toml")
    venv = _environment(tmp_path / "venv")
    log = venv / "calls.log"
    temporary = tmp_path / "tmp"  # dev's own scratch files go here, and must not stay
    temporary.mkdir()

    def dev(command: str, **env: str) -> list[str]:
        run = subprocess.run([str(clone / "dev"), command], cwd=clone, capture_output=True,
                             text=True, timeout=scaled(60),
                             env={**_without_reinstall(), "ACCEL_CTX_VENV": str(venv),
                                  "TMPDIR": str(temporary), **env})
        assert run.returncode == 0, run.stderr
        assert not list(temporary.iterdir()), command  # CI runs dev again and again
        calls = log.read_text().splitlines()
        log.unlink()
        return calls

    assert dev("demo") == ["pip install .", "launch"]  # a fresh environment
    assert dev("demo") == ["launch"]  # nothing changed
    assert dev("test") == ["pip install .[dev,docs]", "pytest"]  # the tools it needs
    assert dev("demo") == ["launch"] and dev("test") == ["pytest"]
    with (clone / "pyproject.toml").open("a") as f:
        f.write("\n# a change\n")
    assert dev("demo") == ["pip install .", "launch"]
    assert dev("demo", ACCEL_CTX_REINSTALL="1") == ["pip install .", "launch"]
