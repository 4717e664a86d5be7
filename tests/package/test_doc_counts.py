"""The pages type no count a command can make (issue 52): test counts went stale as tests were
added (316 and 1,296 stated, 322 and 1,323 collected; a version table row said 75 of 85), so
the pages name ``python docs/_ext/doc_counts.py``, which counts them, and what the pages do say
(the version table's files, the same-data warning's steps) is held to the code here."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from accel_ctx._data import replica_inputs

from ..conftest import COMPAT

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "README.pypi.md", *sorted((ROOT / "docs").glob("*.md"))]
# "316 tests", "307 passed", "1,296 tests", and a file's count in a table: "`x.py` (75)"
TYPED_COUNT = re.compile(r"\b\d[\d,]*\s+(?:tests?|passed|skipped|failed|deselected)\b"
                         r"|\.py`\s*\(\d+")


def _doc_counts():  # docs/_ext is no package: loaded from its file
    spec = importlib.util.spec_from_file_location("doc_counts",
                                                  ROOT / "docs" / "_ext" / "doc_counts.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _prose(page: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside code blocks."""
    out, in_code = [], False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
        elif not in_code:
            out.append((number, line))
    return out


def test_no_page_types_a_count_of_tests():
    typed = [f"{page.relative_to(ROOT)}:{number}: {match.group(0)!r}"
             for page in PAGES for number, line in _prose(page)
             for match in TYPED_COUNT.finditer(line)]
    assert not typed, (
        "a count of tests typed into the docs goes stale as tests are added: say what the tests "
        "are and point at `python docs/_ext/doc_counts.py`, which counts them:\n"
        + "\n".join(typed))


def test_the_pages_that_speak_of_the_tests_size_name_the_command_that_counts_it():
    for page in ("README.md", "docs/install.md"):
        assert "python docs/_ext/doc_counts.py" in (ROOT / page).read_text(), page


def test_the_version_tables_rows_name_files_of_the_compat_tier():
    rows = _doc_counts().version_table_rows()
    assert len(rows) >= 8, rows
    outside = {f for feature, files in rows if "fp8" in feature for f in files}
    assert outside == {"precision/test_fp8.py"}  # the one row the page says is not in the tier
    for feature, files in rows:
        assert files, feature
        for name in files:
            assert (ROOT / "tests" / name).is_file(), (feature, name)
            assert (name in COMPAT) == (name not in outside), (feature, name)


def test_doc_counts_reads_each_form_of_pytests_collection_line():
    count_in = _doc_counts().count_in
    assert count_in("a::b\n85 tests collected in 1.47s\n") == 85
    assert count_in("316/1323 tests collected (1007 deselected) in 9.0s") == 316
    assert count_in("1 test collected in 0.1s") == 1
    assert count_in("no tests collected (11 deselected) in 0.60s") == 0
    assert count_in("ERROR collecting") is None


def test_the_same_data_warnings_step_count_is_the_codes():
    # the README said "first 3 training steps"; the check warns after replica_inputs.STEPS
    readme = (ROOT / "README.md").read_text()
    assert f"When a model's first {replica_inputs.STEPS} training steps had inputs" in readme
    assert re.findall(r"first (\d+) training steps", readme) == [str(replica_inputs.STEPS)]
