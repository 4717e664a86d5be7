"""The CPU-seconds each test file costs, counted by the kernel: ``pytest --record-cpu FILE``.

Wall time says little about the suite's cost on two cores, where it is CPU-bound and a file's
seconds depend on what the other worker runs beside it. CPU-seconds do not. Each pytest process
that runs tests (each xdist worker, or the one process under ``-n 0``) moves itself into a
cgroup of its own (cgroup v1 ``cpuacct``, or v2 ``cpu.stat``), which every process it starts
inherits: spawned ranks, launchers, the workers they start, and those that outlive a test. The
counter is read around each test and summed by file. The controlling process also reads the
machine's whole counter over the run, so what ran outside the workers shows as the difference.

The result (JSON: ``{"machine": s, "tests": s, "files": {path: s}}``, ``tests`` the files' sum)
goes to FILE; the summary prints at the end. ``ACCEL_CTX_CPU_BY_TEST=1`` counts each test
instead of each file. A group is removed by the next run, once its processes are gone (a
worker is still in its own when the run ends). Needs write access to the cgroup tree (root in
a container, as on CI's machine); ``./dev test`` does not ask for it.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import defaultdict
from collections.abc import Generator
from pathlib import Path

import pytest

OPTION = "--record-cpu"
_V1 = Path("/sys/fs/cgroup/cpuacct")
_V2 = Path("/sys/fs/cgroup")


class Counter:
    """One cgroup's CPU-seconds (all its processes, living and exited)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def seconds(self) -> float:
        if (self.folder / "cpuacct.usage").exists():
            return int((self.folder / "cpuacct.usage").read_text()) / 1e9
        stat = dict(line.split() for line in (self.folder / "cpu.stat").read_text().splitlines())
        return int(stat["usage_usec"]) / 1e6


def tree() -> Path | None:
    """The cgroup tree whose counters this reads (v1 ``cpuacct``, else v2), None if neither."""
    if (_V1 / "cpuacct.usage").exists():
        return _V1
    if (_V2 / "cgroup.procs").exists() and (_V2 / "cpu.stat").exists():
        return _V2
    return None


def _root() -> Path:
    found = tree()
    if found is not None:
        return found
    raise pytest.UsageError(f"{OPTION} needs cgroup CPU accounting (neither {_V1} nor a cgroup "
                            f"v2 tree at {_V2} is there)")


def own_group(name: str) -> Counter:
    """A new cgroup named ``name`` holding this process (and all it starts from now on)."""
    folder = _root() / name
    try:
        folder.mkdir(exist_ok=True)
        (folder / "cgroup.procs").write_text(f"{os.getpid()}\n")
    except OSError as exc:
        raise pytest.UsageError(f"{OPTION}: cannot make or join the cgroup {folder} ({exc}); "
                                "it needs write access to the cgroup tree") from exc
    return Counter(folder)


class WorkerRecorder:
    """Runs in each process that runs tests: sums the cgroup's seconds by test file."""

    def __init__(self, out: Path, worker: str) -> None:
        self.out, self.worker = out, worker
        self.counter = own_group(f"accel-ctx-tests-{os.getpid()}")
        self.files: dict[str, float] = defaultdict(float)
        self.by_test = os.environ.get("ACCEL_CTX_CPU_BY_TEST") == "1"  # each test, not file

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None, object, object]:
        before = self.counter.seconds()
        try:
            return (yield)
        finally:
            name = item.nodeid if self.by_test else item.nodeid.split("::", 1)[0]
            self.files[name] += self.counter.seconds() - before

    def pytest_sessionfinish(self) -> None:
        part = self.out.with_name(f"{self.out.name}.{self.worker}")
        part.write_text(json.dumps({"files": self.files}))


class Summary:
    """Runs in the controlling process: the machine's counter over the run, the parts merged."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.machine = Counter(_root())
        self.start = self.machine.seconds()
        for stale in _root().glob("accel-ctx-tests-*"):  # earlier runs' groups, now empty
            with contextlib.suppress(OSError):
                stale.rmdir()

    @pytest.hookimpl(trylast=True)  # after the workers' parts are written
    def pytest_sessionfinish(self) -> None:
        machine = self.machine.seconds() - self.start
        files: dict[str, float] = defaultdict(float)
        for part in sorted(self.out.parent.glob(f"{self.out.name}.*")):
            data = json.loads(part.read_text())
            for name, seconds in data["files"].items():
                files[name] += seconds
            part.unlink()
        ordered = dict(sorted(files.items(), key=lambda kv: -kv[1]))
        self.out.write_text(json.dumps({"machine": round(machine, 1), "tests": round(
            sum(files.values()), 1), "files": {k: round(v, 1) for k, v in ordered.items()}},
            indent=1) + "\n")

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        data = json.loads(self.out.read_text()) if self.out.exists() else None
        if data:
            terminalreporter.write_line(
                f"CPU-seconds: {data['tests']:.0f} in the tests' processes, {data['machine']:.0f} "
                f"on the whole machine over the run ({self.out})")


def configure(config: pytest.Config) -> None:
    """Registers the recorders ``--record-cpu FILE`` asks for in this process."""
    value = config.getoption("record_cpu", None)
    if not value:
        return
    out = Path(value).resolve()
    worker = getattr(config, "workerinput", {}).get("workerid")
    if worker is None:  # the controller; it runs the tests itself unless xdist hands them out
        config.pluginmanager.register(Summary(out), "accel_ctx-cpu-summary")
        if config.getoption("numprocesses", None):
            return
        worker = "main"
    config.pluginmanager.register(WorkerRecorder(out, worker), "accel_ctx-cpu")
