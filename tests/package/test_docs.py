"""Every code block of the documentation runs, or says why it cannot (``<!-- not run: why -->``
on the line before it). Blocks pulled in from README.md (``--8<-- "README.md:name"``) count too.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .._timeouts import scaled

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").glob("*.md"))
INCLUDE = re.compile(r'^--8<-- "([^":]+)(?::([\w-]+))?"\s*$')
NOT_RUN = re.compile(r"^<!-- not run: (.+\S) -->$")


def _expand(path: Path) -> list[tuple[str, int, str]]:
    """(file, line number, text) of every line, includes expanded."""
    out = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        match = INCLUDE.match(line)
        if match is None:
            out.append((path.name, number, line))
            continue
        source = ROOT / match.group(1)
        lines = list(enumerate(source.read_text().splitlines(), 1))
        if match.group(2):
            start = next(i for i, t in lines if t == f"<!-- --8<-- [start:{match.group(2)}] -->")
            end = next(i for i, t in lines if t == f"<!-- --8<-- [end:{match.group(2)}] -->")
            lines = lines[start:end - 1]
        out += [(source.name, n, t) for n, t in lines]
    return out


def _blocks() -> list[dict[str, object]]:
    blocks = []
    for page in PAGES:
        lines = _expand(page)
        i = 0
        while i < len(lines):
            name, number, text = lines[i]
            if text.startswith("```") and text.strip() != "```":
                language = text.strip("`").split()[0]
                previous = next((t for _, _, t in reversed(lines[:i]) if t.strip()), "")
                reason = NOT_RUN.match(previous.strip())
                body = []
                i += 1
                while not lines[i][2].startswith("```"):
                    body.append(lines[i][2])
                    i += 1
                blocks.append({"where": f"{page.name} ({name}:{number})", "language": language,
                               "reason": reason.group(1) if reason else None,
                               "code": "\n".join(body)})
            i += 1
    return blocks


def test_every_block_runs_or_says_why_not():
    unmarked = [b["where"] for b in _blocks() if b["language"] != "python" and not b["reason"]]
    assert not unmarked, f"blocks neither runnable Python nor marked <!-- not run: why -->: {unmarked}"


def test_the_runnable_blocks_run(tmp_path):
    runnable = [b for b in _blocks() if b["language"] == "python" and not b["reason"]]
    assert len(runnable) >= 8
    script = (
        "import json, sys, traceback\n"
        "failed = []\n"
        "for block in json.load(open(sys.argv[1])):\n"
        "    try:\n"
        "        exec(compile(block['code'], block['where'], 'exec'), {'__name__': '__main__'})\n"
        "    except BaseException:\n"
        "        failed.append(block['where'] + '\\n' + traceback.format_exc())\n"
        "print('\\n\\n'.join(failed))\n"
        "sys.exit(1 if failed else 0)\n"
    )
    (tmp_path / "blocks.json").write_text(json.dumps(runnable))
    (tmp_path / "run.py").write_text(script)
    out = subprocess.run([sys.executable, "run.py", "blocks.json"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=scaled(300))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_the_cli_page_names_every_launcher_setting():
    from accel_ctx._launch.settings import CONFIG_FLAG, SETTINGS

    page = (ROOT / "docs" / "cli.md").read_text()
    text = "\n".join(t for _, _, t in _expand(ROOT / "docs" / "cli.md"))
    missing = [f for s in SETTINGS for f in s.flags if f"`{f}" not in text]
    missing += [f"{s.key} = " for s in SETTINGS if f"\n{s.key} = " not in text]  # the file
    missing += [CONFIG_FLAG] if f"`{CONFIG_FLAG}" not in text else []
    assert not missing, f"docs/cli.md does not name: {missing}"
    # The precedence rule is written once, in README.md, and included where it is needed.
    assert '--8<-- "README.md:precedence"' in page


def _accelerate_lrs(batches: int, world: int, k: int, lr: float, gamma: float) -> list[float]:
    """Accelerate's learning rate after each micro-batch of one process: a prepared StepLR
    (step_size=1) steps ``num_processes`` times when the optimizer stepped (``sync_gradients``:
    every k-th micro-batch and the loader's last), never in between (AcceleratedScheduler.step)."""
    per_rank = batches // world
    moves, out = 0, []
    for i in range(1, per_rank + 1):
        if i % k == 0 or i == per_rank:
            moves += world
        out.append(lr * gamma ** moves)
    return out


def test_the_accelerate_schedule_lines_give_accelerates_learning_rates(tmp_path):
    from .._spawn import spawn
    from ..workers.docs_blocks import run_block

    block = next(b for b in _blocks() if "Accelerate's schedule" in str(b["code"]))
    assert block["reason"] is None and "accumulate(2)" in str(block["code"])
    for rank, lrs in enumerate(spawn(run_block, 2, tmp_path, block["code"], block["where"],
                                      "lrs")):
        assert lrs == pytest.approx(_accelerate_lrs(16 // 2, 2, 2, 0.01, 0.5)), rank
    assert _accelerate_lrs(8, 2, 2, 0.01, 0.5) == pytest.approx([0.01, 0.0025, 0.0025, 0.000625])
