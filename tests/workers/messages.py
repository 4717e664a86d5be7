"""Workers of tests/ranks/test_messages.py: evaluations whose results go to per-rank files (told
nothing) beside ones that count only their share (warned), in one spawn."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel_ctx import distributed, log_metrics, main_print, sharded, state


def _data() -> TensorDataset:
    x = torch.randn(96, 8, generator=torch.Generator().manual_seed(3))
    return TensorDataset(x, (x[:, 0] > 0).long())


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def _predict_to_torch_file(folder: str) -> None:
    """A sharded inference script: each rank opens its file, predicts, then torch.saves there."""
    with sharded():
        model = _model()
        model.eval()
        loader = DataLoader(_data(), batch_size=8)
        predictions = []
        with open(os.path.join(folder, f"preds-{state().rank}.pt"), "wb") as f, torch.no_grad():
            for x, _ in loader:
                predictions.append(model(x).argmax(dim=1))
            torch.save(torch.cat(predictions), f)
        main_print("predictions written")


def _predict_to_open_file(folder: str) -> None:
    """Each rank writes a line per sample into its own file, opened before the loop."""
    with distributed():
        model = _model()
        loader = DataLoader(_data(), batch_size=8)
        with torch.no_grad(), open(os.path.join(folder, f"preds-{state().rank}.txt"), "w") as f:
            for x, _ in loader:
                f.writelines(f"{p}\n" for p in model(x).argmax(dim=1).tolist())


def _predict_to_json(folder: str) -> None:
    """Each rank keeps its predictions and dumps them as JSON into the file it opened."""
    with distributed():
        model = _model()
        loader = DataLoader(_data(), batch_size=8)
        rows = []
        with open(Path(folder, f"preds-{state().rank}.json"), "w") as out:
            with torch.no_grad():
                for x, _ in loader:
                    rows += model(x).argmax(dim=1).tolist()
            json.dump(rows, out)


def _count_own_share(folder: str) -> None:
    """The MNIST example's test(), twice (a loader each): counts its share, prints them and logs
    them (rank 0; TensorBoard's event file stays open and grows)."""
    with distributed():
        model = _model()
        for epoch in range(2):
            loader = DataLoader(_data(), batch_size=8)
            correct = 0
            with torch.no_grad():
                for x, y in loader:
                    correct += int((model(x).argmax(dim=1) == y).sum())
            print(f"Accuracy: {correct}/96")
            log_metrics({"accuracy": correct / 96}, step=epoch,
                        directory=os.path.join(folder, "runs"))


CASES = {"torch_save": _predict_to_torch_file, "open_file": _predict_to_open_file,
         "json": _predict_to_json, "counts_its_share": _count_own_share}


def evaluation_outputs(folder: str) -> dict[str, Any]:
    """Per case, the evaluation warnings this rank saw, and the files the ranks wrote."""
    out: dict[str, Any] = {}
    for name, case in CASES.items():
        where = os.path.join(folder, name)
        os.makedirs(where, exist_ok=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            case(where)
        out[name] = [str(w.message) for w in caught if "an evaluation" in str(w.message)]
    out["files"] = sorted(p.name for p in Path(folder).rglob("preds-*"))
    return out
