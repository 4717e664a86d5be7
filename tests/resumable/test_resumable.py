"""resumable(): a run killed at any moment carries on by itself and ends as if nothing happened.

The kill test is the promise: a 2-rank run (MLP with dropout, AdamW, OneCycleLR, a shuffling
DataLoader sharded by accel_ctx) under `accel-ctx launch --max-restarts`, its ranks SIGKILLed at
seeded random moments (mid-step, mid-save, right after a restart: restore and rendezvous),
ends with weights, optimizer state and every step's loss bit-identical to a run never
interrupted, under distributed() and under sharded(). SIGTERM instead makes every rank save at
the next step boundary: no step is run twice. The single-process tests cover the scope's own
rules in this process; tests/resumable/test_resumable_elastic.py, elastic launcher nodes (a file of their
own, so that the suite's two workers share the launcher runs).
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from accel_ctx import distributed, errors, resumable

from .. import _launcher
from .._timeouts import scaled

SCRIPT = str(_launcher.SCRIPTS / "resumable_train.py")
STEPS = 36  # 3 epochs of 96 samples, batch 4 per rank, 2 ranks
ENGINES = ("ddp", "sharded")


@pytest.fixture(autouse=True)
def _stop_launchers():
    yield
    _launcher.stop_all()


def _losses(out: Path, rank: int) -> list[tuple[int, str, str]]:
    path = out / f"loss.rank{rank}"
    if not path.exists():
        return []
    return [(int(s), loss, attempt) for s, loss, attempt in
            (line.split() for line in path.read_text().splitlines() if line.strip())]


def _start(tmp_path: Path, name: str, engine: str, restarts: int | None = 3,
           log: str | None = None) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """Launch the script on 2 processes, in (or on) ``name``'s folders: (launcher, its log,
    the output folder). ``engine``: "ddp" (distributed()) or "sharded" (distributed(),
    sharded()); ``restarts``: --max-restarts (None: none given)."""
    ckpt, out = tmp_path / f"{name}-ckpt", tmp_path / f"{name}-out"
    out.mkdir(exist_ok=True)
    flags = [] if restarts is None else ["--max-restarts", str(restarts)]
    proc, path = _launcher.start(["-n", "2", *flags, SCRIPT, str(ckpt), str(out), "3", engine],
                                 tmp_path, log or f"{name}.log")
    return proc, path, out


def _run(tmp_path: Path, name: str, kills: int = 0, how: int = signal.SIGKILL,
         seed: int = 0, launcher_last: bool = False, engine: str = "ddp"
         ) -> tuple[Path, str, int]:
    """Launch the script (killing ``kills`` times); (its output folder, log, kills landed).
    ``launcher_last``: the last signal is SIGUSR1 to the launcher, which forwards it."""
    rng = random.Random(seed)
    moments = sorted(rng.sample(range(2, STEPS - 4), kills))
    proc, log, out = _start(tmp_path, name, engine, restarts=kills + 3)
    landed, killed = 0, set()
    deadline = time.monotonic() + scaled(240)
    for at in moments:
        early = how == signal.SIGKILL and rng.random() < 0.3  # restore, rendezvous
        while proc.poll() is None and time.monotonic() < deadline:
            pids = [(out / f"pid.rank{r}").read_text() if (out / f"pid.rank{r}").exists()
                    else "" for r in range(2)]
            fresh = all(p and p not in killed for p in pids)
            lines = _losses(out, 0)
            current = [s for s, _, a in lines if a == str(landed)]
            if fresh and (early or (current and current[-1] >= at)):
                break
            time.sleep(0.005)
        if proc.poll() is not None:
            break
        time.sleep(rng.uniform(0, 1.0) if early else rng.uniform(0, 0.05))
        rank = rng.randrange(2)
        pid = int((out / f"pid.rank{rank}").read_text())
        killed.update((out / f"pid.rank{r}").read_text() for r in range(2))
        sig = how
        if launcher_last and landed == kills - 1:
            pid, sig = proc.pid, signal.SIGUSR1
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            continue
        landed += 1
    code = _launcher.finish(proc, 240)
    text = log.read_text()
    assert code == 0, text[-6000:]
    return out, text, landed


def _final(out: Path, rank: int) -> dict[str, Any]:
    return torch.load(out / f"final.rank{rank}.pt", weights_only=True)


def _same(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


def _references(tmp: Path) -> dict[str, Path]:
    """The run never interrupted, under each engine (the two launched side by side); started
    again once finished, it takes no step. Each engine's output folder."""
    runs = {engine: _start(tmp, engine, engine) for engine in ENGINES}
    for proc, log, out in runs.values():
        assert _launcher.finish(proc, 240) == 0, log.read_text()[-6000:]
        assert [s for s, _, _ in _losses(out, 0)] == list(range(1, STEPS + 1))
    before = {engine: (out / "loss.rank0").read_text() for engine, (_, _, out) in runs.items()}
    again = {engine: _start(tmp, engine, engine, restarts=None, log=f"{engine}-again.log")
             for engine in ENGINES}
    for engine, (proc, log, out) in again.items():
        assert _launcher.finish(proc, 120) == 0, log.read_text()[-4000:]
        assert (out / "loss.rank0").read_text() == before[engine]  # no step ran
        assert "nothing left to run" in log.read_text()
        assert len(list((tmp / f"{engine}-ckpt").glob("ckpt-*"))) == 2  # keep_last
    return {engine: out for engine, (_, _, out) in runs.items()}


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    try:
        return _references(tmp_path_factory.mktemp("references"))
    finally:  # one failed: the other is not left running (no test's teardown stops it)
        _launcher.stop_all()


@pytest.fixture(scope="module")
def reference(references: dict[str, Path]) -> Path:
    return references["ddp"]


@pytest.fixture(scope="module")
def sharded_reference(references: dict[str, Path]) -> Path:
    return references["sharded"]


def _same_as(out: Path, reference: Path) -> None:
    """Every step's loss (a step run again after a kill runs the same) and the final weights
    and optimizer state of each rank equal the uninterrupted run's."""
    for rank in range(2):
        want = {s: loss for s, loss, _ in _losses(reference, rank)}
        got = _losses(out, rank)
        assert {s for s, _, _ in got} == set(want)
        for step, loss, attempt in got:
            assert loss == want[step], (rank, step, attempt, got)
        _same(_final(out, rank), _final(reference, rank))


@pytest.mark.slow
def test_sigkill_at_random_moments_ends_bit_identical(tmp_path, reference, monkeypatch):
    monkeypatch.setenv("STEP_SLEEP", "0.02")
    kills = int(os.environ.get("ACCEL_CTX_TEST_KILLS", "5"))  # the full promise: 20
    out, text, landed = _run(tmp_path, "killed", kills=kills, seed=26)
    assert landed >= kills - 1, text[-4000:]
    _same_as(out, reference)
    attempts = {a for _, _, a in _losses(out, 0)}
    assert len(attempts) >= 3, attempts  # the run went on after several kills


@pytest.mark.slow
def test_sharded_sigkill_at_random_moments_ends_bit_identical(tmp_path, sharded_reference,
                                                              monkeypatch):
    """The same under sharded(): each rank saves and restores its own shards through DCP."""
    monkeypatch.setenv("STEP_SLEEP", "0.02")
    kills = max(3, int(os.environ.get("ACCEL_CTX_TEST_KILLS", "5")) * 3 // 5)
    out, text, landed = _run(tmp_path, "killed", kills=kills, seed=62, engine="sharded")
    assert landed >= kills - 1, text[-4000:]
    _same_as(out, sharded_reference)
    assert len({a for _, _, a in _losses(out, 0)}) >= 3, text[-4000:]


@pytest.mark.slow
def test_sigterm_or_sigusr1_save_at_the_boundary_and_lose_no_step(tmp_path, reference, monkeypatch):
    monkeypatch.setenv("STEP_SLEEP", "0.02")
    out, text, landed = _run(tmp_path, "termed", kills=2, how=signal.SIGTERM, seed=7,
                             launcher_last=True)
    assert landed == 2, text[-4000:]
    assert "SIGTERM received: saved" in text
    assert "SIGUSR1 received: saved" in text  # forwarded by the launcher
    for rank in range(2):
        _same(_final(out, rank), _final(reference, rank))
        steps = [s for s, _, _ in _losses(out, rank)]
        assert steps == list(range(1, STEPS + 1)), steps  # each step exactly once
        want = [loss for _, loss, _ in _losses(reference, rank)]
        assert [loss for _, loss, _ in _losses(out, rank)] == want
    assert len({a for _, _, a in _losses(out, 0)}) == 3


SWITCHES = [("ddp", "sharded"), ("sharded", "ddp")]


@pytest.fixture(scope="module")
def switched(tmp_path_factory: pytest.TempPathFactory
             ) -> dict[tuple[str, str], tuple[Path, list[tuple[int, str]]]]:
    """Each switch's run, both side by side: under the first engine up to half way (STOP_AT),
    then under the other. (Output folder, [(exit code, log)] of each launch) per switch."""
    tmp = tmp_path_factory.mktemp("switch")
    legs: dict[tuple[str, str], list[tuple[int, str]]] = {pair: [] for pair in SWITCHES}
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("STOP_AT", str(STEPS // 2))
            runs = {pair: _start(tmp, "-".join(pair), pair[0]) for pair in SWITCHES}
        for pair, (proc, log, _) in runs.items():
            legs[pair].append((_launcher.finish(proc, 240), log.read_text()))
        then = {pair: _start(tmp, "-".join(pair), pair[1], restarts=None,
                             log=f"{'-'.join(pair)}-then.log") for pair in SWITCHES}
        for pair, (proc, log, _) in then.items():
            legs[pair].append((_launcher.finish(proc, 240), log.read_text()))
    finally:  # one timed out: the other is not left running
        _launcher.stop_all()
    return {pair: (runs[pair][2], legs[pair]) for pair in SWITCHES}


@pytest.mark.slow
@pytest.mark.parametrize("first, then", SWITCHES)
def test_a_run_continues_across_a_switch_between_distributed_and_sharded(
        switched, references, first, then):
    """Saved under one engine, the run continues under the other: DCP re-lays the weights and
    the optimizer state out (whole on each rank <-> each rank's shards), the loaders go on
    from the saved positions. Up to the switch the run is the first engine's, bit for bit;
    after it, the second engine's arithmetic: equal to its uninterrupted run up to rounding
    (on this model and 2 ranks the two engines happen to agree bit for bit)."""
    out, [(code, text), (then_code, then_text)] = switched[first, then]
    assert code == 0, text[-6000:]
    assert then_code == 0, then_text[-6000:]
    assert "resuming from ckpt-" in then_text
    for rank in range(2):
        got = _losses(out, rank)
        assert [s for s, _, _ in got] == list(range(1, STEPS + 1)), got  # each step once
        before = [loss for s, loss, _ in got if s <= STEPS // 2]
        assert before == [loss for s, loss, _ in _losses(references[first], rank)][:STEPS // 2]
        after = torch.tensor([float.fromhex(loss) for s, loss, _ in got if s > STEPS // 2])
        want = torch.tensor([float.fromhex(loss) for s, loss, _ in
                             _losses(references[then], rank)])
        torch.testing.assert_close(after, want[STEPS // 2:], rtol=1e-5, atol=1e-6)
        final, ref = _final(out, rank), _final(references[then], rank)
        assert final["step"] == ref["step"] and final["lr"] == ref["lr"]
        for part in ("params", "optimizer"):
            assert final[part].keys() == ref[part].keys()
            for key, value in ref[part].items():
                torch.testing.assert_close(final[part][key], value, rtol=1e-5, atol=1e-6)


# ---- one process -------------------------------------------------------------------------------
class _Net(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(width, 2)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.lin(x))


def _train(folder: Path, steps: int, stop_at: int | None = None, width: int = 4,
           **kwargs: Any) -> tuple[list[float], dict[str, Any], Any]:
    """A step-based loop; ``stop_at``: raise there (the process "dies" without a final save)."""
    losses: list[float] = []
    try:
        with distributed(), resumable(folder, **kwargs) as run:
            torch.manual_seed(0)
            model = _Net(width)
            opt = torch.optim.AdamW(model.parameters(), lr=0.05)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            run.track(best=1e9)
            while run.step < steps:
                if stop_at is not None and run.step == stop_at:
                    raise KeyboardInterrupt
                loss = model(torch.randn(8, width)).pow(2).mean()
                loss.backward()
                opt.step()
                sched.step()
                opt.zero_grad()
                run.values["best"] = min(run.values["best"], loss.item())
                losses.append(loss.item())
            values = dict(run.values)
            resumed = run.resumed
    except KeyboardInterrupt:
        return losses, {}, None
    return losses, {"model": model.state_dict(), "opt": opt.state_dict()["state"],
                    "lr": opt.param_groups[0]["lr"], "values": values}, resumed


def test_a_step_loop_resumes_bit_identical_in_one_process(tmp_path):
    full, want, _ = _train(tmp_path / "a", 9)
    first, _, _ = _train(tmp_path / "b", 9, stop_at=7, every_steps=3)  # saved at 3 and 6
    rest, got, resumed = _train(tmp_path / "b", 9, every_steps=3)
    assert resumed and first == full[:7] and rest == full[6:]
    _same(got, want)


def test_refuses_objects_that_do_not_match_and_another_script(tmp_path):
    _train(tmp_path, 2, every_steps=1)
    with pytest.raises(errors.CheckpointError, match=r"model called 1st.*model0"):
        _train(tmp_path, 4, width=5, every_steps=1)
    meta = tmp_path.parent / "other"
    from accel_ctx._checkpoint import restore

    # the script's identity is given (under pytest-xdist __main__ has no file to read)
    real = restore.script_identity
    restore.script_identity = lambda: ("/here/train.py", "1" * 64)
    try:
        _train(meta, 2, every_steps=1)
        restore.script_identity = lambda: ("/elsewhere/other_script.py", "0" * 64)
        with pytest.raises(errors.CheckpointError, match="written by the script"):
            _train(meta, 4, every_steps=1)
    finally:
        restore.script_identity = real


def test_misuse_is_refused_with_the_cause(tmp_path):
    for bad in ({"every_steps": 0}, {"every_minutes": -1}, {"keep_last": 0}):
        with pytest.raises(errors.ConfigurationError):
            resumable(tmp_path, **bad)
    with distributed(), resumable(tmp_path / "one"), pytest.raises(  # two runs, one folder
            errors.CheckpointError, match="another run is using"), resumable(tmp_path / "one"):
        pass
    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if not os.access(locked, os.W_OK):  # root writes anyway
            with pytest.raises(errors.CheckpointError, match="cannot write"):
                _train(locked, 1)
    finally:
        locked.chmod(0o700)


def test_a_failed_save_warns_and_training_goes_on(tmp_path, monkeypatch):
    from accel_ctx._checkpoint import files

    real = files.begin
    calls = []

    def full_disk(root: Path, step: int) -> Path:
        calls.append(step)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        return real(root, step)

    monkeypatch.setattr(files, "begin", full_disk)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, _, _ = _train(tmp_path, 4, every_steps=2)
    assert len(losses) == 4 and calls == [2, 4]  # step 4's save is the final checkpoint
    assert any("could not be saved" in str(w.message) and "no space left" in str(w.message)
               for w in caught)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt-")) == [
        "ckpt-000001-step4"]


def test_keeps_the_last_checkpoints_and_the_tracked_values(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="accel_ctx.checkpoint"):
        _, first, _ = _train(tmp_path, 6, every_steps=1, keep_last=2)
        # the final checkpoint is step 6's periodic save, not a second save of that step
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt-")) == [
            "ckpt-000005-step5", "ckpt-000006-step6"]
        caplog.clear()
        losses, again, resumed = _train(tmp_path, 6, every_steps=1, keep_last=2)
    assert resumed and losses == []
    assert again["values"] == first["values"] and json.dumps(first["values"])
    assert "nothing left to run" in caplog.text
    assert "resuming from" not in caplog.text  # a finished run says only that


def test_a_finished_run_started_again_names_the_objects_it_could_not_restore(tmp_path, caplog):
    _, trained, _ = _train(tmp_path, 3, every_steps=1)
    with caplog.at_level(logging.WARNING, logger="accel_ctx.checkpoint"):
        losses, built, _ = _train(tmp_path, 3, every_steps=1)
    assert losses == [] and not torch.equal(built["model"]["lin.weight"], trained["model"]["lin.weight"])
    assert "model0, optimizer0, scheduler0 of checkpoint ckpt-" in caplog.text
    assert "were not restored" in caplog.text and "run.track(" in caplog.text


def test_the_run_can_be_read_after_its_block(tmp_path):
    with distributed(), resumable(tmp_path, every_steps=2) as run:
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        while run.step < 3:
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert (run.step, run.resumed, run.finished) == (3, False, True)  # `print(run.step)` after
    assert run.checkpoint is None and run.values == {}
    with pytest.raises(errors.ConfigurationError, match="inside its `with resumable"):
        run.track(best=1.0)


def test_a_signal_before_the_first_step_saves_that_step_and_the_next_run_goes_on(tmp_path, capsys):
    def run_once(signal_first: bool) -> list[int]:
        steps = []
        with distributed(), resumable(tmp_path) as run:
            torch.manual_seed(0)
            model = nn.Linear(4, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            if signal_first:
                os.kill(os.getpid(), signal.SIGTERM)  # before the first step has finished
            while run.step < 3:
                model(torch.randn(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
                steps.append(run.step)
        return steps

    with pytest.raises(SystemExit) as ended:
        run_once(True)
    assert ended.value.code == 128 + signal.SIGTERM
    assert "SIGTERM received: saved" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt-")) == [
        "ckpt-000001-step1"]
    assert run_once(False) == [2, 3]


def test_a_signal_during_the_restore_saves_at_the_first_boundary_and_keeps_the_previous(
        tmp_path, monkeypatch, capsys):
    from accel_ctx._checkpoint import restore

    _train(tmp_path, 9, stop_at=2, every_steps=1)  # checkpoints of steps 1 and 2
    real = restore.Checkpoint.restore_session

    def signalled(self: Any, *args: Any) -> Any:
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while the run restores
        return real(self, *args)

    monkeypatch.setattr(restore.Checkpoint, "restore_session", signalled)
    with pytest.raises(SystemExit) as ended:
        _train(tmp_path, 9, every_steps=5)
    assert ended.value.code == 128 + signal.SIGTERM
    assert "SIGTERM received: saved" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt-")) == [
        "ckpt-000002-step2", "ckpt-000003-step3"]


def _gan(folder: Path, steps: int, stop_at: int | None = None) -> dict[str, Any] | None:
    """A second model and optimizer met only every 4th step (a critic, an evaluation model)."""
    try:
        with distributed(), resumable(folder, every_steps=1) as run:
            torch.manual_seed(0)
            model, critic = nn.Linear(4, 2), nn.Linear(4, 1)
            opt = torch.optim.AdamW(model.parameters(), lr=0.05)
            critic_opt = torch.optim.SGD(critic.parameters(), lr=0.1, momentum=0.9)
            while run.step < steps:
                if run.step == stop_at:
                    raise KeyboardInterrupt
                x = torch.randn(8, 4)
                model(x).pow(2).mean().backward()
                opt.step()  # first: keys follow the order objects are first met
                opt.zero_grad()
                if run.step % 4 == 1:
                    critic(x).pow(2).mean().backward()
                    critic_opt.step()
                    critic_opt.zero_grad()
    except KeyboardInterrupt:
        return None
    return {"model": model.state_dict(), "critic": critic.state_dict(),
            "critic_opt": critic_opt.state_dict()["state"]}


def test_objects_not_met_again_before_a_save_are_kept_across_two_restarts(tmp_path):
    want = _gan(tmp_path / "a", 10)
    _gan(tmp_path / "b", 10, stop_at=6)  # the critic trained after steps 1 and 5
    _gan(tmp_path / "b", 10, stop_at=8)  # saved at 7 and 8, the critic not met again
    got = _gan(tmp_path / "b", 10)
    _same(got, want)


def test_periodic_saves_are_written_in_the_background_exactly_as_staged(tmp_path, monkeypatch):
    import threading

    from accel_ctx._checkpoint import files

    real, threads = files.publish, []

    def publish(*args: Any, **kwargs: Any) -> Path:
        threads.append(threading.current_thread() is threading.main_thread())
        time.sleep(0.05)  # a slow disk: training goes on meanwhile
        return real(*args, **kwargs)

    monkeypatch.setattr(files, "publish", publish)
    full, want, _ = _train(tmp_path / "a", 9)
    first, _, _ = _train(tmp_path / "b", 9, stop_at=7, every_steps=3)
    assert threads[-2:] == [False, False]  # steps 3 and 6: written by the saver thread
    rest, got, _ = _train(tmp_path / "b", 9, every_steps=3)
    assert first == full[:7] and rest == full[6:]  # step 6's state, not a later one
    _same(got, want)


def test_under_slurm_a_signal_saves_and_requeues_the_job(tmp_path, monkeypatch, capsys):
    record = tmp_path / "scontrol.args"
    stand_in = tmp_path / "scontrol"
    stand_in.write_text(f'#!/bin/sh\necho "$@" > {record}\n')
    stand_in.chmod(0o755)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("ACCEL_CTX_SCONTROL", str(stand_in))
    with pytest.raises(SystemExit) as exited, distributed(), resumable(tmp_path / "r") as run:
        model = nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        while run.step < 5:
            if run.step == 2:
                os.kill(os.getpid(), signal.SIGUSR1)  # SLURM's --signal=USR1@90
            model(torch.ones(2)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert exited.value.code == 128 + signal.SIGUSR1
    assert record.read_text().split() == ["requeue", "4242"]
    assert "SLURM job 4242 requeued" in str(exited.value)
    assert (tmp_path / "r" / "ckpt-000001-step3").is_dir()


def test_the_boundary_group_waits_only_the_jobs_timeout_for_a_dead_peer(monkeypatch):
    """The boundary's agreement runs on a gloo group of its own; torch gives a new group 30
    minutes, so a rank whose peer died waited there long past ``distributed(timeout=...)``
    (seen once in CI: 390 s after the peer's save failed). The group takes the job's timeout."""
    from datetime import timedelta

    import torch.distributed as dist

    from accel_ctx._checkpoint import dcp, restore

    made: list[dict[str, Any]] = []
    monkeypatch.setattr(dcp, "collective", lambda: True)
    monkeypatch.setattr(dist, "new_group", lambda **kwargs: made.append(kwargs) or "group")
    assert restore.new_group(2, timedelta(seconds=7)) == "group"
    assert made == [{"backend": "gloo", "timeout": timedelta(seconds=7)}]
    assert restore.new_group(1, timedelta(seconds=7)) is None  # one process: no group
