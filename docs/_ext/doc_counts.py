"""How many tests the suite, its tiers and each row of docs/install.md's version table hold,
counted by pytest's collection (a few seconds): the docs type no count, which would go stale
as tests are added.

    python docs/_ext/doc_counts.py

Run from the repository's root with the environment the tests use (``. .venv/bin/activate``).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INSTALL = ROOT / "docs" / "install.md"
_COLLECTED = re.compile(r"^(?:(\d+)/)?(\d+) tests? collected|^no tests collected")


def version_table_rows(page: str | None = None) -> list[tuple[str, list[str]]]:
    """(feature, test files under tests/) of each row of install.md's version table."""
    text = INSTALL.read_text() if page is None else page
    rows = []
    for line in text[text.index("| feature | tests"):].splitlines()[2:]:
        if not line.startswith("|"):
            break
        feature, tests = (cell.strip() for cell in line.strip("|").split("|")[:2])
        rows.append((feature, re.findall(r"`([\w/]+\.py)`", tests)))
    return rows


def count_in(output: str) -> int | None:
    """The tests selected, from the last line of ``pytest --collect-only -q``: "85 tests
    collected", "316/1323 tests collected (1007 deselected)", "no tests collected"."""
    for line in reversed(output.splitlines()):
        match = _COLLECTED.match(line.strip())
        if match:
            return int(match.group(1) or match.group(2)) if match.group(2) else 0
    return None


def collected(*args: str) -> list[str]:
    """The node ids ``pytest --collect-only`` selects with ``args`` (its count checked)."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    if count_in(out.stdout) != len(ids):
        raise RuntimeError(f"pytest {' '.join(args)}: {len(ids)} tests listed, not its count:\n"
                           f"{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return ids


def _in(ids: list[str], files: list[str]) -> int:
    return sum(1 for i in ids if i.split("::")[0] in files)


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from tests.conftest import COMPAT  # the tier is made of files

    everything = collected()
    tests = [i for i in everything if i.startswith("tests/")]
    fast = collected("--fast")
    print(f"the suite: {len(tests)} tests, and {len(everything) - len(tests)} docstring "
          "examples (python -m pytest)")
    print(f"the compat tier (-m compat): {_in(tests, [f'tests/{f}' for f in COMPAT])}")
    print(f"the fast tier (--fast): {len(fast)}, the docstring examples included")
    print("docs/install.md's version table, per row:")
    for feature, files in version_table_rows():
        print(f"  {_in(tests, [f'tests/{f}' for f in files]):5d}  {feature}")


if __name__ == "__main__":
    main()
