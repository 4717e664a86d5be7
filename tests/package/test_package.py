"""The package as users meet it on PyPI: its metadata and the description PyPI shows.

The built wheel and sdist themselves are checked in CI (.ci/run: `twine check --strict`, the
sdist's examples/ and docs/, the wheel installed into a fresh environment).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # a dependency there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _description() -> str:
    return (ROOT / PROJECT["readme"]).read_text()


def test_the_metadata_a_well_kept_package_has():
    classifiers = PROJECT["classifiers"]
    oldest = re.fullmatch(r">=3\.(\d+)", PROJECT["requires-python"])
    assert oldest is not None
    versions = sorted(int(c.rsplit(".", 1)[1]) for c in classifiers
                      if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c))
    assert versions and versions[0] == int(oldest.group(1))  # from the oldest supported on
    assert versions == list(range(versions[0], versions[-1] + 1))  # without a gap
    assert ("Typing :: Typed" in classifiers) == (ROOT / "accel_ctx" / "py.typed").exists()
    assert any(c.startswith("Topic :: ") for c in classifiers)
    assert PROJECT["license"] == "Apache-2.0" and PROJECT["authors"] and PROJECT["keywords"]
    urls = PROJECT["urls"]
    assert {"Documentation", "Source", "Issues", "Changelog"} <= set(urls)
    repo = re.search(r"^repo_url: (\S+)$", (ROOT / "mkdocs.yml").read_text(), re.M)
    assert repo is not None and urls["Source"] == repo.group(1)  # the one repository
    assert urls["Issues"] == f"{repo.group(1)}/issues"
    assert urls["Changelog"].endswith("/CHANGELOG.md") and (ROOT / "CHANGELOG.md").exists()


def test_the_description_pypi_shows_reads_right_outside_a_clone():
    text = _description()
    commands = "\n".join(re.findall(r"```bash\n(.*?)```", text, re.S))
    assert "./dev" not in commands and "pip install accel-ctx" in commands  # no clone needed
    links = re.findall(r"\]\(([^)]+)\)", text) + re.findall(r"https?://\S+", text)
    assert all(link.startswith("https://") for link in links), links  # no path into a clone
    assert "examples/" not in re.sub(r"https://\S+", "", text)


def test_the_descriptions_training_loop_runs(capsys):
    [block] = re.findall(r"```python\n(.*?)```", _description(), re.S)
    exec(compile(block, "README.pypi.md", "exec"), {"__name__": "__main__"})
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["epoch 0", "epoch 1", "epoch 2"]
    assert float(lines[-1].split("loss ")[1]) < 0.3  # it learns
