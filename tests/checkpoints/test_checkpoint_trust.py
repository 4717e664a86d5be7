"""Checkpoints that cannot fool anyone (issue 11, points 4, 8 and 14).

A damaged checkpoint (a bit flipped in a shard, an RNG file, DCP's metadata or the manifest; a
file truncated, missing or added) is never loaded: ``load_state`` falls back to the one before it
with a warning naming the file, or raises when that folder was asked for. A full disk says so and
leaves nothing half-written; one save per folder at a time; an optimizer over other parameters,
a path that is a file and a missing checkpoint are all said plainly. Spawned (gloo, 2 ranks):
checkpoint calls made on one rank only raise within the arrival timeout, naming the rank that
never came; damage found by rank 1 sends both ranks back; a full disk on rank 1 fails both.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import signal
import subprocess
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from accel_ctx import distributed, errors, load_state, save_model, save_state
from accel_ctx._checkpoint import files, guard

from .._spawn import spawn
from .._timeouts import hint, scaled
from ..workers import checkpoint_trust as trust
from ..workers.common import MLP, params


def _model(value: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Every weight a distinct known number, so a flipped bit is a wrong weight, not a crash."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) / 1000 + value)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 64)).sum().backward()
    opt.step()  # a momentum buffer: the optimizer goes through DCP too
    opt.zero_grad()
    return model, opt


def _two(root: Path) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """Two checkpoints; the older one's weights."""
    model, opt = _model(1.0)
    older = save_state(root, model=model, optimizer=opt)
    expected = params(model)
    model, opt = _model(2.0)
    newer = save_state(root, model=model, optimizer=opt)
    return older, newer, expected


def _offset_of(path: Path, *tensors: torch.Tensor) -> int:
    """Where the bytes of one of ``tensors`` lie in ``path``: their middle byte."""
    data = path.read_bytes()
    for tensor in tensors:
        raw = tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()
        if (at := data.find(raw)) >= 0:
            return at + len(raw) // 2
    raise AssertionError(f"{path.name} does not hold those bytes")


def _load(root: Path) -> tuple[object, dict[str, torch.Tensor], list[str]]:
    model, opt = _model(0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = load_state(root, model=model, optimizer=opt)
    return resumed, params(model), [str(w.message) for w in caught]


def _shard_weight(folder: Path) -> None:
    shard = next(folder.glob("*.distcp"))
    trust.flip_byte(shard, _offset_of(shard, *(_model(v)[0][0].weight for v in (1.0, 2.0))))


def _rng_state(folder: Path) -> None:
    rng = torch.load(folder / "rank0.pt", weights_only=True)["rng"]
    cpu = next(v for v in rng.values() if isinstance(v, torch.Tensor) and v.numel() > 1000) \
        if isinstance(rng, dict) else None
    target = folder / "rank0.pt"
    if cpu is None:  # whatever the layout, the CPU generator's state is in there
        cpu = torch.get_rng_state()
    trust.flip_byte(target, _offset_of(target, cpu))


def _metadata(folder: Path) -> None:
    trust.flip_byte(folder / ".metadata")


def _manifest_step(folder: Path) -> None:
    path = folder / "manifest.json"
    path.write_bytes(path.read_bytes().replace(b'"step": 0', b'"step": 1'))


def _truncate_rng(folder: Path) -> None:
    path = folder / "rank0.pt"
    path.write_bytes(path.read_bytes()[:-10])


def _delete_shared(folder: Path) -> None:
    (folder / "accel_ctx.pt").unlink()


def _extra_file(folder: Path) -> None:
    (folder / "__1_0.distcp").write_bytes(b"not part of this checkpoint")


DAMAGE = {
    "bit in a weight of a shard": (_shard_weight, "__0_0.distcp"),
    "bit in the RNG state": (_rng_state, "rank0.pt"),
    "bit in DCP's metadata": (_metadata, ".metadata"),
    "step in the manifest": (_manifest_step, "manifest.json"),
    "truncated RNG file": (_truncate_rng, "rank0.pt"),
    "missing file": (_delete_shared, "accel_ctx.pt"),
    "extra file": (_extra_file, "__1_0.distcp"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damage_falls_back_to_the_checkpoint_before_naming_the_file(tmp_path, damage):
    make, name = DAMAGE[damage]
    older, newer, expected = _two(tmp_path)
    make(newer)
    resumed, loaded, warned = _load(tmp_path)
    assert resumed.path == older  # type: ignore[attr-defined]
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())
    assert any(name in w and str(newer) in w for w in warned), warned
    # asked for that folder itself: no silent fallback
    with pytest.raises(errors.CheckpointError, match=name.replace(".", r"\.")):
        load_state(newer, model=_model(0.0)[0])
    # the older one damaged too: an error, not a fresh start that would rotate them away
    make(older)
    with pytest.raises(errors.CheckpointError, match=r"no checkpoint in .* is intact"):
        _load(tmp_path)


def test_an_intact_checkpoint_loads_and_records_every_file_checksum(tmp_path):
    _, newer, _ = _two(tmp_path)
    manifest = json.loads((newer / "manifest.json").read_text())
    assert manifest["format"] == 2
    assert set(manifest["crc32"]) == set(manifest["files"]) == {
        p.name for p in newer.iterdir()} - {"manifest.json"}
    resumed, loaded, warned = _load(tmp_path)
    assert resumed.path == newer and not warned  # type: ignore[attr-defined]
    assert all(torch.equal(loaded[k], v) for k, v in params(_model(2.0)[0]).items())


def test_a_checkpoint_without_checksums_loads_unverified_only_as_format_1(tmp_path):
    _, newer, _ = _two(tmp_path)
    path = newer / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["crc32"], manifest["manifest_crc32"]
    path.write_text(json.dumps({**manifest, "format": 2}))  # checksums stripped: refused
    with pytest.raises(errors.CheckpointError, match="format 2"):
        load_state(newer, model=_model(0.0)[0])
    path.write_text(json.dumps({**manifest, "format": 1}))  # as written before checksums
    with pytest.warns(UserWarning, match="without checksums: its content cannot be verified"):
        assert load_state(tmp_path, model=_model(0.0)[0]).path == newer


def test_a_full_disk_says_so_and_leaves_nothing_half_written(tmp_path, monkeypatch):
    model, opt = _model(1.0)
    good = save_state(tmp_path, model=model, optimizer=opt)
    begin = files.begin
    for victim in ["__0_0.distcp", ".metadata.tmp", "rank0.pt", "accel_ctx.pt", "manifest.json"]:
        def trapped(root: Path, step: int, victim: str = victim) -> Path:
            tmp = begin(root, step)
            os.symlink("/dev/full", tmp / victim)  # the kernel's own ENOSPC on every write
            return tmp

        monkeypatch.setattr(files, "begin", trapped)
        with pytest.raises(errors.CheckpointError) as info:
            save_state(tmp_path, model=model, optimizer=opt)
        text = str(info.value)
        assert "no space left on device" in text and str(tmp_path) in text, (victim, text)
        assert "Free space" in text
        assert sorted(p.name for p in tmp_path.iterdir()) == [good.name], victim
    monkeypatch.setattr(files, "begin", begin)
    resumed, _, warned = _load(tmp_path)
    assert resumed.path == good and not warned  # type: ignore[attr-defined]
    # save_model likewise: the file it replaces is left as it was
    target = tmp_path / "weights" / "model.pt"
    save_model(model, target)
    before = target.read_bytes()
    os.symlink("/dev/full", target.with_name(f".model.pt.tmp-{os.getpid()}"))
    with pytest.raises(errors.CheckpointError, match="save_model: no space left on device"):
        save_model(model, target)
    assert target.read_bytes() == before and os.listdir(target.parent) == ["model.pt"]


def test_a_real_full_file_system(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)],
                                 capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a 1 MiB tmpfs here: {exc}")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a 1 MiB tmpfs here (root needed): {mounted.stderr.strip()}")
    try:
        model = nn.Linear(300, 300)  # 361 KB of weights: two checkpoints do not fit in 1 MiB
        good = save_state(disk, model=model)
        save_state(disk, keep_last=None, model=model)
        with pytest.raises(errors.CheckpointError, match="no space left on device"):
            for _ in range(3):
                save_state(disk, keep_last=None, model=model)
        assert not [p for p in disk.iterdir() if not p.name.startswith("ckpt-")]
        fresh = nn.Linear(300, 300)
        resumed = load_state(good, model=fresh)
        assert resumed.path == good and torch.equal(fresh.weight, model.weight)
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_a_second_save_into_a_folder_being_saved_into_is_refused(tmp_path):
    root, ready = tmp_path / "ckpt", tmp_path / "ready"
    model = MLP()
    save_state(root, model=model)
    ctx = mp.get_context("spawn")
    holder = ctx.Process(target=trust.hold_the_lock, args=(str(root), str(ready)))
    holder.start()
    try:
        deadline = time.monotonic() + scaled(120)
        while not ready.exists() and holder.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), f"the holding save never got to its lock: {hint()}"
        with pytest.raises(errors.CheckpointError) as info:
            save_state(root, model=model)
        text = str(info.value)
        assert "another save into" in text and f"process {holder.pid} on host" in text, text
        assert "give each job its own folder" in text
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # dies mid-save, its lock file left behind
        holder.join(30)
    assert (root / guard.LOCK).exists()
    path = save_state(root, model=model)  # a dead process's lock is taken over
    assert not (root / guard.LOCK).exists()
    assert sorted(p.name for p in root.iterdir()) == ["ckpt-000001-step0", path.name]
    assert load_state(root, model=MLP()).path == path
    # the same process saving from two places at once (another thread, say) is refused too
    held = guard.FolderLock(root).acquire()
    try:
        with pytest.raises(errors.CheckpointError, match=f"process {os.getpid()} on host"):
            save_state(root, model=model)
    finally:
        held.release()


def test_a_folder_lock_is_not_kept_by_the_loader_workers_of_a_killed_holder(tmp_path):
    # resumable() holds its folder's lock for the whole run, and a DataLoader forks its workers
    # meanwhile; a rank killed by SIGKILL leaves them alive for seconds (until they see their
    # parent gone). Its restart must take the folder over at once, not find it "in use".
    root = tmp_path / "ckpt"
    root.mkdir()
    held = guard.FolderLock(root).acquire()
    loader = torch.utils.data.DataLoader(range(8), num_workers=1,
                                         multiprocessing_context="fork")
    batches = iter(loader)
    next(batches)  # the worker forked and alive
    try:
        assert held.fd is not None
        os.close(held.fd)  # what the kernel does to a process killed now: its fds, not the worker's
        held.fd = None
        taken = guard.FolderLock(root).acquire()
        taken.release()
    finally:
        del batches  # the worker stops


def test_an_optimizer_over_other_parameters_names_them(tmp_path):
    model, opt = _model(1.0)
    save_state(tmp_path / "a", model=model, optimizer=opt)
    other = nn.Linear(3, 3)
    with pytest.raises(errors.CheckpointError) as info:
        load_state(tmp_path / "a", model=_model(0.0)[0], optimizer=torch.optim.SGD(
            other.parameters(), lr=0.1, momentum=0.9))
    text = str(info.value)
    assert "'optimizer' was saved over the parameters of model" in text
    assert "lacks 0.weight, 0.bias, 1.weight, 1.bias" in text
    assert "2 parameter(s) that are not in model (shapes (3, 3), (3,))" in text
    fresh = _model(0.0)[0]
    with pytest.raises(errors.CheckpointError, match=r"lacks 1\.weight, 1\.bias"):
        load_state(tmp_path / "a", model=fresh, optimizer=torch.optim.SGD(
            fresh[0].parameters(), lr=0.1, momentum=0.9))
    # an optimizer saved before its first step (kept as a plain state_dict) too
    plain = MLP()
    save_state(tmp_path / "b", model=plain, optimizer=torch.optim.SGD(plain.parameters(), lr=1))
    fresh_mlp = MLP()
    with pytest.raises(errors.CheckpointError, match="that are not in model"):
        load_state(tmp_path / "b", model=fresh_mlp,
                   optimizer=torch.optim.SGD(MLP().parameters(), lr=1))


def test_a_file_is_not_a_checkpoint_folder(tmp_path):
    path = tmp_path / "model.pt"
    torch.save(MLP().state_dict(), path)
    with pytest.raises(errors.CheckpointError, match=r"model\.pt is a file, not a checkpoint"):
        load_state(path, model=MLP())
    with pytest.raises(errors.CheckpointError, match=r"model\.pt is a file, not a folder"):
        save_state(path, model=MLP())


def test_no_checkpoint_is_said_once_and_required_raises(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="accel_ctx")
    for _ in range(3):
        assert not load_state(tmp_path / "runs", model=MLP())
    said = [r.getMessage() for r in caplog.records if "starting fresh" in r.getMessage()]
    assert said == [f"no checkpoint in {tmp_path / 'runs'}: starting fresh"]
    with pytest.raises(errors.CheckpointError, match=r"required=True\): no checkpoint in"):
        load_state(tmp_path / "runs", required=True, model=MLP())


def test_the_arrival_timeout_is_bounded_and_configurable(monkeypatch):
    monkeypatch.delenv(guard.ARRIVAL_ENV, raising=False)
    with distributed(timeout=7):
        assert guard.arrival_timeout() == 7  # the group's, when under 60 s
    with distributed(timeout=600):
        assert guard.arrival_timeout() == 60
    monkeypatch.setenv(guard.ARRIVAL_ENV, "2.5")
    assert guard.arrival_timeout() == 2.5
    for bad in ["0", "-1", "nan", "inf", "soon"]:
        monkeypatch.setenv(guard.ARRIVAL_ENV, bad)
        with pytest.raises(errors.ConfigurationError, match=guard.ARRIVAL_ENV):
            guard.arrival_timeout()


# ---- on 2 real ranks -----------------------------------------------------------------------------
def test_checkpoint_calls_on_one_rank_only_name_the_rank_that_never_came(tmp_path):
    out = spawn(trust.one_rank_calls, 2, tmp_path, str(tmp_path / "files"), timeout=180)
    for n, call in enumerate(["save_state()", "save_model()", "load_state()"]):
        alone, late = out[0][f"alone{n}"], out[1][f"late{n}"]
        assert alone.startswith("DistributedError: rank 0: ") and (
            f"{call} must be called on every rank; rank(s) [1] never arrived") in alone, alone
        arrival = out[0]["arrival"]  # 4 s, scaled (a busy machine)
        assert "is_main_process" in alone and f"{guard.ARRIVAL_ENV} to more seconds (now {arrival})" in alone
        assert 3 < out[0][f"waited{n}"] < scaled(50)  # 4 s, not distributed(timeout=scaled(60))
        assert f"{call} must be called on every rank; rank 1 came too late" in late, late
    for rank in range(2):
        assert "rank 0 save_state(model=), rank 1 load_state(model=)" in out[rank]["mixed"]
        other = out[rank]["other_objects"]
        assert "rank 0 load_state(model=, optimizer=), rank 1 load_state(model=)" in other, other
        assert "with the same objects under the same names" in other
        assert out[rank]["nothing_written"] == [f"rank0-gave-up-{n}" for n in range(3)]
        assert out[rank]["loaded"] is True
    left = out[0]["after_leaving"]  # ended when rank 1's record said so, not after 4 s
    assert "save_state() must be called on every rank, and rank 1 left distributed() at" in left
    assert "it will never arrive, so rank 0 stopped waiting after" in left, left


def test_damage_found_by_rank_1_and_a_full_disk_on_rank_1(tmp_path):
    out = spawn(trust.damage_and_full_disk, 2, tmp_path, str(tmp_path / "ckpt"), timeout=180)
    victim = out[0]["victim"]
    for rank in range(2):
        assert out[rank]["fell_back"] and out[rank]["weights"], rank
        assert "no space left on device" in out[rank]["full"], out[rank]["full"]
        assert out[rank]["left"] == ["ckpt-000001-step1", "ckpt-000002-step2"]
    assert any(victim in w for w in out[0]["warnings"]), out[0]["warnings"]
    assert "rank 1 failed to write" in out[0]["full"]
