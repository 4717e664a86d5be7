"""``./dev flaky FILE... [-n N]``: the given test files run N times in a row; pass counts per file.

A multi-process test that fails one run in ten lands nothing one CI in ten. Each round is one
pytest run of all the files (on the suite's workers, a file each), its results read from a
JUnit XML report; a file passes a round when none of its tests failed or errored there. Prints
one line per file, ``k/N passed``, and the tests that failed with the rounds they failed in;
exits 0 only when every file passed every round.

    ./dev flaky tests/distributed/test_replica_groups.py -n 10
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def _module(path: str) -> str:
    return Path(path).with_suffix("").as_posix().replace("/", ".")


def _failures(report: Path, files: list[str]) -> tuple[dict[str, list[str]], set[str]]:
    """Per file, the tests that failed or errored; and the files none of whose tests ran."""
    failed: dict[str, list[str]] = defaultdict(list)
    ran: set[str] = set()
    modules = {_module(f): f for f in files}
    for case in ET.parse(report).iter("testcase"):
        classname = case.get("classname", "")  # the module, or module.Class
        owner = next((f for m, f in modules.items()
                      if classname == m or classname.startswith(m + ".")), None)
        if owner is None:
            continue
        ran.add(owner)
        if case.find("failure") is not None or case.find("error") is not None:
            failed[owner].append(case.get("name", "?"))
    return failed, set(files) - ran


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="./dev flaky", description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", metavar="FILE")
    parser.add_argument("-n", "--rounds", type=int, default=10, metavar="N")
    parser.add_argument("--workers", type=int,
                        default=int(os.environ.get("ACCEL_CTX_TEST_WORKERS", "2")))
    options, pytest_args = parser.parse_known_args(argv)
    files = [Path(f).as_posix() for f in options.files]
    missing = [f for f in files if not Path(f).is_file()]
    if missing or options.rounds < 1:
        parser.error(f"no such file: {', '.join(missing)}" if missing else "-n must be 1 or more")
    passes = dict.fromkeys(files, 0)
    failures: dict[str, dict[str, list[int]]] = {f: defaultdict(list) for f in files}
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as folder:
        for round_ in range(1, options.rounds + 1):
            report = Path(folder) / f"round{round_}.xml"
            workers = ["-n", str(options.workers), "--dist", "loadfile"] if options.workers else []
            code = subprocess.call(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *workers,
                 f"--junitxml={report}", *pytest_args, *files],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            failed, unrun = _failures(report, files) if report.exists() else ({}, set(files))
            for f in files:
                for name in failed.get(f, []) + (["(no test ran)"] if f in unrun else []):
                    failures[f][name].append(round_)
                if f not in failed and f not in unrun:
                    passes[f] += 1
            print(f"round {round_}/{options.rounds}: pytest exit {code}, "
                  f"{time.monotonic() - began:.0f} s so far", flush=True)
    for f in files:
        print(f"{passes[f]}/{options.rounds} passed  {f}")
        for name, rounds in failures[f].items():
            print(f"    {name}: failed in round(s) {', '.join(map(str, rounds))}")
    return 0 if all(n == options.rounds for n in passes.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
