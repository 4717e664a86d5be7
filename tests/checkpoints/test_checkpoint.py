"""save_state / load_state / save_model in one process: layout, rotation, resume, safe loading."""

from __future__ import annotations

import json
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from accel_ctx import (
    Resumed,
    accumulate,
    distributed,
    errors,
    load_state,
    mixed_precision,
    save_model,
    save_state,
    skip_first_batches,
    state,
)
from accel_ctx._checkpoint import model as model_file

from ..workers.common import MLP, make_data, params


def _fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = MLP()
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    F.cross_entropy(model(torch.randn(4, 8)), torch.tensor([0, 1, 2, 0])).backward()
    opt.step()
    opt.zero_grad()


# ---- nothing to load -----------------------------------------------------------------------------
def test_without_a_checkpoint_load_state_loads_nothing_and_says_so(tmp_path):
    model, opt = _fresh()
    before = params(model)
    resumed = load_state(tmp_path / "missing", model=model, optimizer=opt)
    assert resumed == Resumed() and not resumed and resumed.path is None
    assert (resumed.step, resumed.epoch) == (0, 0)
    assert not (tmp_path / "missing").exists()
    assert all(torch.equal(v, params(model)[k]) for k, v in before.items())
    assert not load_state(tmp_path)  # an empty folder too


# ---- layout, rotation, atomicity -----------------------------------------------------------------
def test_folder_layout_and_keep_last_rotation(tmp_path):
    model, opt = _fresh()
    paths = []
    for _ in range(5):
        _train_step(model, opt)
        paths.append(save_state(tmp_path, model=model, optimizer=opt))
    assert [p.name for p in paths] == [f"ckpt-{i:06d}-step0" for i in range(1, 6)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [p.name for p in paths[-3:]]
    newest = paths[-1]
    names = {p.name for p in newest.iterdir()}
    assert {".metadata", "accel_ctx.pt", "rank0.pt", "manifest.json"} <= names
    manifest = json.loads((newest / "manifest.json").read_text())
    assert manifest["objects"] == ["model", "optimizer"] and manifest["world_size"] == 1
    assert set(manifest["files"]) == names - {"manifest.json"}
    fresh, fresh_opt = _fresh()
    assert load_state(tmp_path, model=fresh, optimizer=fresh_opt).path == newest
    assert all(torch.equal(v, params(fresh)[k]) for k, v in params(model).items())
    save_state(tmp_path, keep_last=None, model=model)
    save_state(tmp_path, keep_last=None, model=model)
    assert len(list(tmp_path.iterdir())) == 5


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_keep_last_must_be_a_positive_count(tmp_path, bad):
    with pytest.raises(errors.ConfigurationError, match="keep_last"):
        save_state(tmp_path, keep_last=bad, model=nn.Linear(2, 2))


def test_incomplete_checkpoints_are_skipped_with_a_warning(tmp_path):
    model, opt = _fresh()
    good = save_state(tmp_path, model=model, optimizer=opt)
    _train_step(model, opt)
    newer = save_state(tmp_path, model=model, optimizer=opt)
    (newer / "manifest.json").unlink()  # as if the rename had happened without it
    (tmp_path / ".tmp-ckpt-000009-step0").mkdir()  # a save killed half-way
    fresh, fresh_opt = _fresh()
    with pytest.warns(UserWarning, match="incomplete checkpoint") as caught:
        resumed = load_state(tmp_path, model=fresh, optimizer=fresh_opt)
    assert resumed.path == good
    text = " ".join(str(w.message) for w in caught)
    assert ".tmp-ckpt-000009-step0" in text and newer.name in text
    # the next save clears what the killed one left
    save_state(tmp_path, model=model)
    assert not (tmp_path / ".tmp-ckpt-000009-step0").exists()


def test_a_truncated_file_makes_the_checkpoint_incomplete_naming_the_file(tmp_path):
    model, opt = _fresh()
    good = save_state(tmp_path, model=model, optimizer=opt)
    bad = save_state(tmp_path, model=model, optimizer=opt)
    data = next(bad.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])
    with pytest.warns(UserWarning, match=data.name):
        assert load_state(tmp_path, model=model, optimizer=opt).path == good
    with pytest.raises(errors.CheckpointError, match="truncated"):
        load_state(bad, model=model)  # asked for this one: no silent fallback


@pytest.mark.parametrize("victim", [".metadata", "__0_0.distcp", "rank0.pt", "accel_ctx.pt"])
def test_a_corrupt_file_says_which_file(tmp_path, victim):
    model, opt = _fresh()
    _train_step(model, opt)
    path = save_state(tmp_path, model=model, optimizer=opt)
    target = path / victim
    data = bytearray(target.read_bytes())
    data[:64] = os.urandom(64)  # same size: only reading it can tell
    target.write_bytes(bytes(data))
    fresh, fresh_opt = _fresh()
    with pytest.raises(errors.CheckpointError, match=victim.replace(".", r"\.")):
        load_state(tmp_path, model=fresh, optimizer=fresh_opt)


# ---- safe loading --------------------------------------------------------------------------------
class _Boom:
    """Unpickling this runs ``Path.touch`` on the marker: it must never happen."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (Path(self.marker),))


class _Holder:
    def __init__(self, value: object) -> None:
        self.value = value

    def state_dict(self) -> dict[str, object]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.value = state["value"]


def test_nothing_in_a_checkpoint_is_executed(tmp_path):
    marker = tmp_path / "executed"
    root = tmp_path / "ckpt"
    path = save_state(root, model=nn.Linear(2, 2), extra=_Holder(_Boom(str(marker))))
    assert not marker.exists()
    with pytest.raises(errors.CheckpointError, match=r"extra\.value"):
        load_state(root, extra=_Holder(0))
    assert not marker.exists()
    # DCP's own metadata file is a pickle: a malicious one is refused, not run
    (path / ".metadata").write_bytes(pickle.dumps(_Boom(str(marker))))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][".metadata"] = (path / ".metadata").stat().st_size
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(errors.CheckpointError, match="metadata"):
        load_state(root, model=nn.Linear(2, 2))
    assert not marker.exists()


def test_a_checkpoint_of_another_model_names_the_keys_that_differ(tmp_path):
    save_state(tmp_path, model=MLP())

    class Wider(MLP):
        def __init__(self) -> None:
            super().__init__()
            self.net[0] = nn.Linear(8, 64)
            self.net[2] = nn.Linear(64, 3)
            self.head = nn.Linear(3, 3)

    with pytest.raises(errors.CheckpointError) as info:
        load_state(tmp_path, model=Wider())
    text = str(info.value)
    assert "head.weight" in text and "missing from the checkpoint" in text
    assert "net.0.weight (32, 8) in the checkpoint, (64, 8) here" in text
    no_bias = MLP()
    no_bias.net[2] = nn.Linear(32, 3, bias=False)
    with pytest.raises(errors.CheckpointError, match=r"model'.*; not in model: net\.2\.bias\."):
        load_state(tmp_path, model=no_bias)


def test_unknown_names_and_objects_without_state(tmp_path):
    save_state(tmp_path, model=MLP())
    with pytest.raises(errors.CheckpointError, match="holds no 'ema'; it holds model"):
        load_state(tmp_path, ema=MLP())
    with pytest.raises(errors.ConfigurationError, match=r"save_state\(steps=...\).*int"):
        save_state(tmp_path, steps=3)


# ---- resuming in one process ---------------------------------------------------------------------
def _loop(root: Path, stop: int | None, epochs: int = 3, workers: int = 0,  # type: ignore[no-untyped-def]
          save_every: int = 0, fused: bool = False):
    with distributed(), mixed_precision("fp16", init_scale=2.0**20, growth_interval=3), \
            accumulate(3):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.Linear(16, 3))
        opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=fused)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        loader = DataLoader(make_data(72), batch_size=4, shuffle=True, num_workers=workers)
        resumed = load_state(root, model=model, optimizer=opt, scheduler=sched)
        micro, seen = 0, []
        for _ in range(resumed.epoch, epochs):
            for x, y in loader:
                seen.append(x[:, 0].tolist())
                F.cross_entropy(model(x), y).backward()
                opt.step()
                sched.step()
                opt.zero_grad()
                micro += 1
                if micro == stop:
                    save_state(root, model=model, optimizer=opt, scheduler=sched)
                    return seen, None
                if save_every and micro % save_every == 0:
                    save_state(root, model=model, optimizer=opt, scheduler=sched)
        return seen, (params(model), opt.state_dict()["state"], state().step,
                      state().skipped_steps, state().loss_scale, sched.last_epoch)


@pytest.mark.parametrize(("stop", "fused"), [(1, False), (7, False), (18, False), (25, False),
                                             (7, True), (18, True)])
def test_one_process_resumes_bit_identically(tmp_path, stop, fused):
    # fused: the optimizer skips overflowed steps on the device; the counts are read at saving
    full_seen, full = _loop(tmp_path / "none", None, fused=fused)
    before, _ = _loop(tmp_path / "ckpt", stop, fused=fused)
    after, resumed = _loop(tmp_path / "ckpt", None, fused=fused)
    assert before + after == full_seen
    assert resumed is not None and full is not None
    assert all(torch.equal(resumed[0][k], v) for k, v in full[0].items())
    for key, per_param in full[1].items():
        assert all(torch.equal(resumed[1][key][n], v) for n, v in per_param.items())
    assert resumed[2:] == full[2:]
    assert full[3] > 0 and full[5] == full[2] - full[3]  # skips happened; the schedule skipped them


def test_resume_with_loader_workers(tmp_path):
    full_seen, full = _loop(tmp_path / "none", None, epochs=2, workers=2)
    before, _ = _loop(tmp_path / "ckpt", 10, epochs=2, workers=2)
    after, resumed = _loop(tmp_path / "ckpt", None, epochs=2, workers=2)
    assert before + after == full_seen
    assert full is not None and resumed is not None
    assert all(torch.equal(resumed[0][k], v) for k, v in full[0].items())


def test_saving_changes_nothing_in_the_running_job(tmp_path):
    _, full = _loop(tmp_path / "none", None, epochs=2)
    _, saving = _loop(tmp_path / "ckpt", None, epochs=2, save_every=2)  # mid-group ones too
    assert full is not None and saving is not None
    assert all(torch.equal(saving[0][k], v) for k, v in full[0].items())
    assert saving[2:] == full[2:]
    # An optimizer with no state yet stays without (DCP would take a zero step to make one)
    with distributed():
        torch.manual_seed(0)
        model, opt = _fresh()
        save_state(tmp_path / "early", model=model, optimizer=opt)
        assert not opt.state and state().step == 0
        _train_step(model, opt)
        assert opt.state_dict()["state"][0]["step"].item() == 1 and state().step == 1
    fresh, fresh_opt = _fresh()
    load_state(tmp_path / "early", model=fresh, optimizer=fresh_opt)
    assert not fresh_opt.state


class _Sized(Dataset[int]):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> int:
        return i


def test_a_finished_epoch_resumes_with_the_next_one(tmp_path):
    def run(stop: bool) -> list[list[int]]:
        with distributed():
            torch.manual_seed(3)
            loader = DataLoader(_Sized(), batch_size=2, shuffle=True)
            resumed = load_state(tmp_path, train=loader)
            seen = []
            for epoch in range(resumed.epoch, 3):
                seen += [b.tolist() for b in loader]
                if stop and epoch == 0:
                    save_state(tmp_path, train=loader)
                    return seen
            return seen

    with distributed():
        torch.manual_seed(3)
        loader = DataLoader(_Sized(), batch_size=2, shuffle=True)
        full = [b.tolist() for _ in range(3) for b in loader]
    first = run(True)
    rest = run(False)
    assert first + rest == full
    assert load_state(tmp_path).epoch == 1


def test_a_checkpoint_saved_before_the_loader_is_iterated_again_keeps_its_position(tmp_path):
    """A resumed session that saves before iterating (a finished run re-run, an early save)
    must not write the loader's epoch as 0: the next resume would start the run over."""
    model = nn.Linear(2, 2)

    def session(stop_after: int | None) -> tuple[int, list[list[int]]]:
        with distributed():
            torch.manual_seed(3)
            loader = DataLoader(_Sized(), batch_size=2, shuffle=True)
            resumed = load_state(tmp_path, model=model)  # the loader: by order, iterated later
            if stop_after == 0:
                save_state(tmp_path, model=model)  # before iterating: position kept as loaded
                return resumed.epoch, []
            seen = []
            for _ in range(resumed.epoch, 3):
                for b in loader:
                    seen.append(b.tolist())
                    if stop_after is not None and len(seen) == stop_after:
                        save_state(tmp_path, model=model)
                        return resumed.epoch, seen
            return resumed.epoch, seen

    with distributed():
        torch.manual_seed(3)
        loader = DataLoader(_Sized(), batch_size=2, shuffle=True)
        full = [b.tolist() for _ in range(3) for b in loader]
    _, first = session(len(full) // 2)
    epoch, _ = session(0)  # resumed, saved again at once
    _, rest = session(None)
    assert epoch == load_state(tmp_path).epoch > 0
    assert first + rest == full


class _Seen(Dataset[int]):
    """24 samples (12 batches of 2), noting each index loaded."""

    def __init__(self) -> None:
        self.loaded: list[int] = []

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> int:
        self.loaded.append(i)
        return i


@pytest.mark.parametrize("by_name", [False, True])
def test_accelerates_resume_that_also_skips_the_seen_batches_skips_them_once(tmp_path, by_name):
    """Accelerate's checkpointing example, moved with its calls mapped one to one: load_state,
    then skip_first_batches(loader, resume_step). load_state already restored the position, so
    the second skip is ignored with a warning, and the run trains on every batch exactly once."""
    checkpointing_steps = 5

    def main(resume: bool, stop_at: int | None) -> list[int]:
        with distributed():
            torch.manual_seed(42)
            data = _Seen()
            model = nn.Linear(1, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            train_dataloader = DataLoader(data, batch_size=2, shuffle=True)
            overall_step, starting_epoch, resume_step = 0, 0, None
            loaders = {"train": train_dataloader} if by_name else {}
            if resume:
                load_state(tmp_path, model=model, optimizer=opt, **loaders)
                path = sorted(tmp_path.glob("ckpt-*"))[-1].name  # the step is in the folder's name
                resume_step = int(path.split("-step")[1])
                starting_epoch = resume_step // len(train_dataloader)
                resume_step -= starting_epoch * len(train_dataloader)
            for epoch in range(starting_epoch, 2):
                if resume and epoch == starting_epoch and resume_step is not None:
                    active_dataloader = skip_first_batches(train_dataloader, resume_step)
                    overall_step += resume_step
                else:
                    active_dataloader = train_dataloader
                for batch in active_dataloader:
                    loss = model(batch.float().view(-1, 1)).pow(2).mean()
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    overall_step += 1
                    if overall_step % checkpointing_steps == 0:
                        save_state(tmp_path, model=model, optimizer=opt, **loaders)
                    if overall_step == stop_at:
                        return data.loaded
            return data.loaded

    full = main(False, None)
    first = main(False, checkpointing_steps)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rest = main(True, None)
    assert first + rest == full  # 24 batches: none lost, none twice
    said = [w for w in caught if "skip_first_batches(loader, 5) ignored" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    assert "drop the skip_first_batches() call" in str(said[0].message)
    assert said[0].filename == __file__  # at the user's line


# ---- save_model ----------------------------------------------------------------------------------
def test_save_model_writes_plain_weights_loadable_without_accel_ctx(tmp_path):
    with distributed():
        model = MLP()
        model(torch.randn(2, 8))  # adopted
        path = save_model(model, tmp_path / "model.pt")
    assert path == tmp_path / "model.pt" and [p.name for p in tmp_path.iterdir()] == ["model.pt"]
    weights = torch.load(path, weights_only=True)
    assert sorted(weights) == sorted(model.state_dict())  # no module. prefix
    fresh = MLP()
    fresh.load_state_dict(weights)
    assert all(torch.equal(v, params(model)[k]) for k, v in params(fresh).items())


def test_save_model_safetensors_with_tied_weights(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # tied
    path = save_model(model, tmp_path / "model.safetensors")
    assert path.suffix == ".safetensors"
    fresh = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    fresh.load_state_dict(safetensors.load_file(path))
    assert torch.equal(fresh[1].weight, model[0].weight)


def test_save_model_without_safetensors_writes_a_torch_file_and_warns(tmp_path, monkeypatch):
    monkeypatch.setattr(model_file, "_safetensors_available", lambda: False)
    with pytest.warns(UserWarning, match="safetensors package is not installed"):
        path = save_model(MLP(), tmp_path / "model.safetensors")
    assert path == tmp_path / "model.pt"
    MLP().load_state_dict(torch.load(path, weights_only=True))


def test_save_model_replaces_a_file_only_once_complete(tmp_path, monkeypatch):
    path = tmp_path / "model.pt"
    save_model(MLP(), path)
    before = path.read_bytes()

    def fail(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", fail)
    with pytest.raises(OSError, match="disk full"), warnings.catch_warnings():
        save_model(MLP(), path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["model.pt"]


def test_save_model_to_a_directory_names_the_file_to_give(tmp_path):
    with pytest.raises(errors.ConfigurationError, match=r"directory.*model\.safetensors"):
        save_model(MLP(), tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing written, no temporary file left
