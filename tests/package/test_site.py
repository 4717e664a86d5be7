"""The built documentation site: every docstring example of the API reference shows as code, and
the site works opened from disk (search included, nothing fetched from the network).

The site is built once per test session (``mkdocs build --strict``, about a second plus the
API's analysis), into a temporary folder; without the docs extra the tests are skipped.
"""

from __future__ import annotations

import html
import importlib.util
import inspect
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import accel_ctx
from accel_ctx import errors

ROOT = Path(__file__).resolve().parents[2]
_DOCTEST_FLAG = re.compile(r"\s*# doctest:.*$")


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    missing = [m for m in ("mkdocs", "material", "mkdocstrings_handlers.python")
               if importlib.util.find_spec(m.split(".")[0]) is None]
    if missing:
        pytest.skip(f"the docs extra is not installed ({', '.join(missing)} missing; "
                    "`pip install -e '.[docs]'`): the site cannot be built")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    return out


def _documented() -> Iterator[tuple[str, object]]:
    """Every public object the API page renders: the package's names, the errors, and the
    public methods and properties of the classes among them."""
    names = [(n, getattr(accel_ctx, n)) for n in accel_ctx.__all__ if n != "errors"]
    names += [(f"errors.{n}", getattr(errors, n)) for n in dir(errors)
              if not n.startswith("_") and inspect.isclass(getattr(errors, n))
              and getattr(errors, n).__module__ == errors.__name__]
    for name, obj in names:
        yield name, obj
        if inspect.isclass(obj):
            for member, value in vars(obj).items():
                if not member.startswith("_") and (inspect.isfunction(value) or isinstance(
                        value, (property, classmethod, staticmethod))):
                    yield f"{name}.{member}", value


def _examples(obj: object) -> list[str]:
    """The doctest source lines (``>>>`` and ``...``) of each example in the docstring."""
    doc = obj.__doc__ if isinstance(obj, (property, classmethod, staticmethod)) else inspect.getdoc(obj)
    if not doc or ">>>" not in doc:
        return []
    examples, current = [], []
    for line in inspect.cleandoc(doc).splitlines():
        text = line.strip()
        if text.startswith((">>> ", "... ")) or text in (">>>", "..."):
            current.append(_DOCTEST_FLAG.sub("", text))
        elif not text and current:  # a blank line ends an example; output lines are skipped
            examples.append("\n".join(current))
            current = []
    if current:
        examples.append("\n".join(current))
    return examples


def _code_blocks(page: str) -> list[str]:
    """The text of every <pre> block of the page, as the reader sees it."""
    blocks = re.findall(r"<pre[^>]*>(.*?)</pre>", page, flags=re.S)
    return [html.unescape(re.sub(r"<[^>]+>", "", b)) for b in blocks]


def _source_lines(block: str) -> str:
    return "\n".join(_DOCTEST_FLAG.sub("", line.rstrip()) for line in block.splitlines()
                     if line.startswith((">>>", "...")))


def test_every_docstring_example_is_shown_as_code(site: Path):
    page = (site / "api.html").read_text()
    shown = [_source_lines(b) for b in _code_blocks(page)]
    examples = {name: _examples(obj) for name, obj in _documented()}
    assert sum(len(e) for e in examples.values()) >= 45  # 49 when written
    missing = [f"{name}:\n{example}" for name, found in examples.items() for example in found
               if not any(example in block for block in shown)]
    assert not missing, "examples not rendered as code blocks:\n\n" + "\n\n".join(missing)
    assert "<blockquote>" not in page  # what a doctest outside an Examples section becomes


def test_the_api_page_links_names_instead_of_showing_sphinx_roles(site: Path):
    page = html.unescape(re.sub(r"<[^>]+>", "", (site / "api.html").read_text()))
    roles = sorted(set(re.findall(r":(?:func|class|meth|attr|mod|data|exc|obj):[\w.~]+", page)))
    assert not roles, roles
    assert 'href="#accel_ctx.errors.DistributedError"' in (site / "api.html").read_text()


def test_the_site_works_from_disk_search_included(site: Path):
    index = (site / "search" / "search_index.js").read_text()
    assert index.startswith("var __index = ") and "gather_for_metrics" in index
    shim = "assets/javascripts/iframe-worker-shim.js"
    assert (site / shim).is_file()
    pages = sorted(p for p in site.rglob("*.html") if p.name != "404.html")  # for servers only
    assert len(pages) >= 20
    for page in pages:
        text = page.read_text()
        depth = "../" * (len(page.relative_to(site).parts) - 1)
        assert f'src="{depth}{shim}"' in text, page
        external = re.findall(r'<(?:script|link)\b[^>]*\b(?:src|href)="((?:https?:)?//[^"]+)"',
                              text)
        assert not external, (page, external)  # fonts, polyfills: nothing from the network
    home = (site / "index.html").read_text()
    assert 'href="api.html"' in home  # file:// opens no folder's index.html by itself


def test_search_answers_in_a_browser_from_disk(site: Path):
    browser = next(filter(None, map(shutil.which, ("chromium", "chromium-browser",
                                                     "google-chrome"))), None)
    if browser is None:
        pytest.skip("no Chromium to open the site with (apt-get install chromium)")
    page = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=15000",
         "--dump-dom", f"{(site / 'index.html').as_uri()}?q=gather_for_metrics"],
        capture_output=True, text=True, timeout=120,
    ).stdout
    found = re.search(r'md-search-result__meta">(\d+) matching document', page)
    assert found and int(found.group(1)) >= 1, page[-2000:]


def test_code_blocks_wrap_instead_of_running_off_the_page(site: Path):
    # issue 52: install.md's commands ran off the page (Material scrolls a block sideways)
    sheet = "assets/stylesheets/extra.css"
    css = re.sub(r"/\*.*?\*/", "", (site / sheet).read_text(), flags=re.S)
    rule = re.search(r"\.md-typeset pre > code\s*\{([^}]*)\}", css)
    assert rule and re.search(r"white-space:\s*pre-wrap", rule.group(1)), css
    for page in sorted(p for p in site.rglob("*.html") if p.name != "404.html"):
        depth = "../" * (len(page.relative_to(site).parts) - 1)
        assert f'href="{depth}{sheet}"' in page.read_text(), page
    # and the install page's own commands fit a narrow column (GitHub shows it unstyled)
    install = (ROOT / "docs" / "install.md").read_text()
    blocks = re.findall(r"^```\w*\n(.*?)^```", install, flags=re.S | re.M)
    long = [line for block in blocks for line in block.splitlines() if len(line) > 80]
    assert not long, long
