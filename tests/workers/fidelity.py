"""Issue 23: scripts written outside this project, by hand (torchrun + DDP) and under accel_ctx.

Each section is written the way third-party scripts are (the PyTorch DDP tutorial's trainer,
per-rank seeds, nanoGPT's micro-steps, the MNIST example's test(), batches made without a
DataLoader) and returns plain data; the tests compare the accel_ctx run with the hand-written
one rank by rank. One spawned run per world size.
"""

from __future__ import annotations

import copy
import gc
import io
import os
import pickle
import threading
import traceback
import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from accel_ctx import (
    distributed,
    find_executable_batch_size,
    gather_for_metrics,
    main_print,
    on_main_process,
    reduce,
    state,
    wait_for_everyone,
)

from . import mingpt as _mingpt
from .common import by_hand


def _rank() -> int:
    return int(os.environ["RANK"])


class Net(nn.Module):
    """A user's model class, as a script defines it (module level, so pickles name it)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---- 1. the DDP tutorial's trainer: a peek at a batch, then set_epoch ---------------------------
def _tutorial_data() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(48, 4, generator=g), torch.randn(48, 1, generator=g))


def _tutorial(model: nn.Module, wrap: bool) -> dict[str, Any]:
    """multigpu_torchrun.py's Trainer._run_epoch, with the model as the script holds it."""
    dataset = _tutorial_data()
    loader = DataLoader(dataset, batch_size=4, pin_memory=False, shuffle=False,
                        sampler=DistributedSampler(dataset))
    if wrap:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    seen: list[list[list[float]]] = []
    for epoch in range(3):
        b_sz = len(next(iter(loader))[0])
        assert b_sz == 4
        loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        seen.append([])
        for source, targets in loader:
            seen[-1].append(source[:, 0].tolist())
            optimizer.zero_grad()
            loss = F.mse_loss(model(source), targets)
            loss.backward()
            optimizer.step()
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return {"seen": seen, "weights": _weights(inner)}


def _linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def tutorial() -> dict[str, Any]:
    reference = by_hand(lambda: _tutorial(_linear(), wrap=True))
    with distributed():
        migrated = _tutorial(_linear(), wrap=False)  # the one-line change: no DDP(...) by hand
    with distributed():
        kept_ddp = _tutorial(_linear(), wrap=True)  # or the script's own DDP kept as it was
    return {"reference": reference, "migrated": migrated, "kept_ddp": kept_ddp}


# ---- 2. per-rank seeds: each rank's own random stream ------------------------------------------
def _seeded_run(workers: int) -> dict[str, Any]:
    torch.manual_seed(1337 + _rank())  # nanoGPT's seed_offset, GAN latents, augmentations
    dataset = TensorDataset(torch.arange(48.0).view(48, 1))  # 12 batches: whole rounds
    loader = DataLoader(dataset, batch_size=4, shuffle=True, num_workers=workers,
                        multiprocessing_context="fork" if workers else None)
    draws = []
    batches = []
    for _ in range(2):
        for (x,) in loader:
            batches.append(x[:, 0].tolist())
        draws.append(torch.randn(3).tolist())  # noise, GAN latents, a dropout mask
    return {"draws": draws, "batches": batches}


def rank_seeds() -> dict[str, Any]:
    out: dict[str, Any] = {"reference": by_hand(_seeded_run, 0)}
    with distributed():
        out["accel"] = _seeded_run(0)
    out["reference_workers"] = by_hand(_seeded_run, 2)
    with distributed():
        out["accel_workers"] = _seeded_run(2)
    return out


# ---- 3. torch.save(model), pickle, deepcopy, repr inside a scope ---------------------------------
def _saved_forms(model: nn.Module) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    try:
        with torch.serialization.safe_globals([Net, nn.Linear, nn.Dropout]):
            loaded = torch.load(buffer, weights_only=True)
        load = {"ok": True, "weights": _weights(loaded), "class": type(loaded).__name__}
    except Exception as exc:  # what a user sees; compared with plain torch's outcome
        load = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    copied = copy.deepcopy(model)
    unpickled = pickle.loads(pickle.dumps(model))
    return {
        "load": load,
        "vars": sorted(vars(model)),
        "deepcopy_vars": sorted(vars(copied)),
        "pickle_vars": sorted(vars(unpickled)),
        "deepcopy_runs": copied(torch.ones(2, 4)).shape == (2, 1),
        "repr": repr(model),
    }


def _one_step(model: nn.Module) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    F.mse_loss(model(torch.randn(6, 4)), torch.zeros(6, 1)).backward()
    opt.step()


def saving() -> dict[str, Any]:
    torch.manual_seed(3)
    plain_model = Net()
    _one_step(plain_model)
    plain = _saved_forms(plain_model)
    torch.manual_seed(3)
    with distributed():
        model = Net()
        _one_step(model)  # adopted, with its DDP engine
        scoped = _saved_forms(model)
        scoped["weights"] = _weights(model)
    return {"plain": plain, "scoped": scoped}


# ---- 4. DDP's own controls: require_backward_grad_sync, no_sync(), .module ---------------------
def _micro_steps(model: nn.Module, style: str, steps: int = 2, micro: int = 3
                 ) -> dict[str, Any]:
    """nanoGPT's loop: the flag set before each micro-step's forward (or no_sync() around it)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + _rank())  # each rank its own data
    local_grads = []
    for _ in range(steps):
        for micro_step in range(micro):
            x, y = torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g)
            last = micro_step == micro - 1
            if style == "flag":
                model.require_backward_grad_sync = last
                (F.mse_loss(model(x), y) / micro).backward()
            elif last:
                (F.mse_loss(model(x), y) / micro).backward()
            else:
                with model.no_sync():  # type: ignore[operator]
                    (F.mse_loss(model(x), y) / micro).backward()
            if micro_step == 0:  # after a micro-step without sync: still this rank's own
                local_grads.append(next(model.parameters()).grad.clone())  # type: ignore[union-attr]
        opt.step()
        opt.zero_grad(set_to_none=True)
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return {"weights": _weights(inner), "local_grads": local_grads}


def ddp_controls() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for style in ("flag", "no_sync"):
        out[f"reference_{style}"] = by_hand(
            lambda style=style: _micro_steps(nn.parallel.DistributedDataParallel(_linear()),
                                             style))
        with distributed():
            out[f"accel_{style}"] = _micro_steps(_linear(), style)
    with distributed():
        model = _linear()
        model(torch.randn(2, 4)).sum().backward()
        try:
            model.module.state_dict()  # type: ignore[operator]
            out["module_error"] = None
        except AttributeError as exc:
            out["module_error"] = str(exc)
        out["hasattr_module"] = hasattr(model, "module")
        out["getattr_default"] = getattr(model, "module", model) is model
        out["default_flag"] = model.require_backward_grad_sync
        out["vars_after"] = sorted(vars(model))
    out["vars_plain"] = sorted(vars(_linear()))
    try:
        _linear().no_sync  # outside every scope: torch's own AttributeError  # noqa: B018
        out["outside"] = None
    except AttributeError as exc:
        out["outside"] = str(exc)
    return out


# ---- 5. the MNIST example's test(): a loop that sums its own counts ------------------------------
def _eval_data() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2500, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


class Perfect(nn.Module):
    """A classifier that is always right on _eval_data (and still has weights to train)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([-x[:, 0], x[:, 0]], dim=1) * self.scale


def _test(model: nn.Module, loader: DataLoader[Any], combine: str) -> int:
    """The MNIST example's test(), as written there, with the ways users combine counts."""
    model.eval()
    correct = 0
    with torch.no_grad():
        for data, target in loader:
            output = model(data)
            pred = output.argmax(dim=1, keepdim=True)
            if combine == "gather_for_metrics":
                pred, target = gather_for_metrics((pred, target))
            correct += int(pred.eq(target.view_as(pred)).sum().item())
    if combine == "reduce":
        correct = int(reduce(torch.tensor(correct)).item())
    if combine == "all_reduce":  # a DDP script's own way
        total = torch.tensor(correct)
        dist.all_reduce(total)
        correct = int(total.item())
    return correct


def _train_step(model: nn.Module) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model.train()
    for data, target in DataLoader(_eval_data(), batch_size=500):
        F.cross_entropy(model(data), target).backward()
        opt.step()
        break


def evaluation() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for combine, even in (("none", True), ("reduce", True), ("gather_for_metrics", True),
                          ("all_reduce", True), ("reduce", False)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with distributed(even_batches=even):
                model = Perfect()
                loader = DataLoader(_eval_data(), batch_size=1000)
                counts = []
                for _ in range(2):  # train, test, train, test: one warning per loader
                    _train_step(model)
                    counts.append(_test(model, loader, combine))
        out[f"{combine}-{even}"] = {
            "counts": counts,
            "warnings": [str(w.message) for w in caught if "evaluation" in str(w.message)],
        }
    return out


# ---- 5b. the MNIST example's shape: loaders local to main(), the evaluation its last loop (#38) --
def _mnist_main(raise_at_end: bool) -> None:
    """pytorch/examples' mnist/main.py in small: main() builds everything, test() is last."""
    model = Perfect()
    train_loader = DataLoader(_eval_data(), batch_size=500, shuffle=True)
    test_loader = DataLoader(_eval_data(), batch_size=1000)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model.train()
    for data, target in train_loader:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()
    correct = _test(model, test_loader, "none")
    print(f"Accuracy: {correct}/{len(test_loader.dataset)}")  # type: ignore[arg-type]
    if raise_at_end:
        raise KeyboardInterrupt  # stopped by hand: the loop may not have been the last


def _shared_dir() -> str:
    """A folder every rank of this spawn sees (the file store's)."""
    return os.path.dirname(os.environ["ACCEL_CTX_INIT_METHOD"].removeprefix("file://"))


def _evaluate_and_combine(how: str) -> DataLoader[Any]:
    """Evaluation scripts that combine their results their own way, the job's last loop."""
    model = Perfect()
    loader = DataLoader(_eval_data(), batch_size=420)  # 6 batches: whole rounds on 2 or 3 ranks
    model.eval()
    if how == "files":  # sharded inference: each rank writes its predictions, rank 0 merges
        path = os.path.join(_shared_dir(), f"predictions-{state().rank}.txt")
        with open(path, "w") as out, torch.no_grad():
            for data, _ in loader:
                out.writelines(f"{p}\n" for p in model(data).argmax(dim=1).tolist())
        wait_for_everyone()
        if state().is_main_process:
            lines = []
            for r in range(state().world_size):
                with open(os.path.join(_shared_dir(), f"predictions-{r}.txt")) as part:
                    lines += part.readlines()
            print(f"{len(lines)} predictions")
    else:  # counts all-reduced on the script's own group
        group = dist.new_group(list(range(dist.get_world_size())))
        correct = torch.tensor(0)
        with torch.no_grad():
            for data, target in loader:
                correct += (model(data).argmax(dim=1) == target).sum()
        dist.all_reduce(correct, group=group)
        print(f"Accuracy: {int(correct)}/{len(loader.dataset)}")  # type: ignore[arg-type]
    return loader


def evaluation_shapes() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case in ("mnist_last", "mnist_raises", "files", "new_group"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with distributed():
                    if case.startswith("mnist"):
                        _mnist_main(case == "mnist_raises")
                    else:  # written at module level: the loader lives to the job's end
                        loader = _evaluate_and_combine(case)  # noqa: F841
            except KeyboardInterrupt:
                pass
        out[case] = [str(w.message) for w in caught if "an evaluation" in str(w.message)]
    return out


# ---- 6. batches made without a DataLoader ----------------------------------------------------------
def _get_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """nanoGPT's get_batch: random windows of one long token stream."""
    g = torch.Generator().manual_seed(seed)
    data = torch.arange(1000) % 17
    ix = torch.randint(len(data) - 8, (4,), generator=g)
    x = torch.stack([data[i:i + 8] for i in ix]).float()
    return x[:, :4], x[:, 4:5]


def identical_inputs() -> dict[str, Any]:
    out = {}
    for case in ("same_seed", "per_rank_seed", "loader", "per_rank_targets", "warm_up"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with distributed():
                model = _linear()
                opt = torch.optim.SGD(model.parameters(), lr=0.01)
                if case in ("loader", "warm_up"):
                    x_all, y_all = _get_batch(0)
                    batches = DataLoader(TensorDataset(x_all, y_all), batch_size=2)
                elif case == "per_rank_targets":  # shared inputs, each rank fits its own targets
                    batches = [(x, y * (1 + _rank())) for x, y in  # type: ignore[assignment]
                               (_get_batch(step) for step in range(3))]
                else:
                    seed = 0 if case == "same_seed" else _rank()
                    batches = [_get_batch(seed + step) for step in range(3)]  # type: ignore[assignment]
                if case == "warm_up":  # one step on a fixed batch before the real loop
                    x, y = _get_batch(0)
                    F.mse_loss(model(x), y).backward()
                    opt.zero_grad()
                for x, y in batches:
                    F.mse_loss(model(x), y).backward()
                    opt.step()
                    opt.zero_grad()
        out[case] = [str(w.message) for w in caught if "identical copies" in str(w.message)]
    return out


# ---- 7. a helper thread of a rank -------------------------------------------------------------------
def helper_thread() -> dict[str, Any]:
    seen: dict[str, Any] = {}

    @on_main_process
    def upload() -> str:
        return "uploaded"

    def work() -> None:
        s = state()
        seen.update(rank=s.rank, world=s.world_size, main=s.is_main_process,
                    scope=s.distributed, upload=upload())
        main_print(f"helper of rank {s.rank}")

    with distributed():
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
    return seen


# ---- 3b. a model dropped by a failed find_executable_batch_size attempt is freed -------------
def dropped_models() -> dict[str, Any]:
    built: list[weakref.ref[nn.Module]] = []

    @find_executable_batch_size(starting_batch_size=8)
    def train(batch_size: int) -> int:
        model = _linear()
        built.append(weakref.ref(model))
        F.mse_loss(model(torch.randn(batch_size, 4)), torch.zeros(batch_size, 1)).backward()
        if batch_size == 8:  # every rank runs out at 8, after DDP took the model on
            raise MemoryError("out of memory")
        return batch_size

    with distributed():
        size = train()
        gc.collect()
        return {"size": size, "first_freed": built[0]() is None,
                "second_kept": built[1]() is not None}


# ---- 9. minGPT's trainer: RandomSampler(replacement=True, num_samples=int(1e10)) ----------------
def mingpt() -> dict[str, Any]:
    world, steps = int(os.environ["WORLD_SIZE"]), 6
    # one process's stream, as many steps as all ranks take together (no group: plain torch)
    out = {"stream": _mingpt.train(world * steps)}
    with distributed():  # the one line the migration adds
        out["rank"] = _mingpt.train(steps, world)
    return out


def run_all() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for section in (tutorial, rank_seeds, saving, dropped_models, ddp_controls, evaluation,
                    evaluation_shapes, identical_inputs, helper_thread, mingpt):
        try:
            out[section.__name__] = section()
        except Exception:  # one section's failure fails its tests only
            out[section.__name__] = {"error": traceback.format_exc()}
    return out
