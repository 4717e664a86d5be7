"""local_sgd() across replica groups: Local SGD and DiLoCo on 2 groups equal the algorithms
written by hand (each group steps on its own batches; every H steps the parameters, or DiLoCo's
pseudo-gradients, are averaged over the groups), and the groups end bit-identical."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from .. import _launcher

pytest.importorskip("torchft", reason="replica groups need torchft (pip install 'accel-ctx[ft]')")

pytestmark = pytest.mark.usefixtures("_stop_launchers")

H, STEPS = 3, 8  # as in tests/scripts/local_sgd_groups.py
OUTER = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)


def _by_hand(start: dict[str, torch.Tensor], seen: list[list[dict[str, Any]]],
             diloco: bool) -> tuple[list[list[dict[str, torch.Tensor]]], list[list[float]]]:
    """Each group's replica trained on the batches it saw; the sync every H steps and at the
    end: the average of the groups' parameters, or DiLoCo's outer step on the average
    pseudo-gradient. Returns each group's weights and losses after each step."""
    models = []
    for _ in seen:
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 1))
        model.load_state_dict(start)
        models.append(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    shared = [p.detach().clone() for p in models[0].parameters()]
    outer = OUTER(shared)

    @torch.no_grad()
    def sync() -> None:
        replicas = [list(m.parameters()) for m in models]
        for i, g in enumerate(shared):
            if diloco:
                g.grad = sum(g - ps[i] for ps in replicas) / len(models)
            else:
                g.copy_(sum(ps[i] for ps in replicas) / len(models))
        if diloco:
            outer.step()
        for ps in replicas:
            for p, g in zip(ps, shared, strict=True):
                p.copy_(g)

    weights: list[list[dict[str, torch.Tensor]]] = [[] for _ in models]
    losses: list[list[float]] = [[] for _ in models]
    for step in range(1, STEPS + 1):
        for g, (model, opt) in enumerate(zip(models, opts, strict=True)):
            batch = seen[g][step - 1]
            loss = F.mse_loss(model(batch["x"]), batch["y"])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[g].append(loss.item())
        if step % H == 0:
            sync()
        for g, model in enumerate(models):
            weights[g].append({k: v.detach().clone() for k, v in model.state_dict().items()})
    if STEPS % H:
        sync()  # leaving the scope ends the period in progress
    for g, model in enumerate(models):
        weights[g].append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return weights, losses


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], **tol: float) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], **tol) for k in a)


def test_local_sgd_and_diloco_over_two_groups_equal_the_algorithms_by_hand(
        tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    script = str(_launcher.SCRIPTS / "local_sgd_groups.py")
    proc, log = _launcher.start(["-n", "1", "--replica-groups", "2", script, str(out)],
                                tmp_path, "groups.log", fork_replica_workers=True)
    code = _launcher.finish(proc, 300)
    assert code == 0, log.read_text(errors="replace")[-3000:]
    groups = [torch.load(out / f"group{g}-rank0.pt") for g in (0, 1)]
    first_step = 1
    for name in ("local_sgd", "diloco"):
        runs = [g[name] for g in groups]
        seen = [r["seen"] for r in runs]
        assert _close(runs[0]["start"], runs[1]["start"], rtol=0, atol=0)
        weights, losses = _by_hand(runs[0]["start"], seen, diloco=name == "diloco")
        for g, run in enumerate(runs):
            # state().step counts the local steps, the same in both groups
            assert [s["step"] for s in run["seen"]] == list(range(first_step, first_step + STEPS))
            assert all(s["groups"] == 2 for s in run["seen"])
            for step, s in enumerate(run["seen"]):
                assert s["loss"] == pytest.approx(losses[g][step], abs=1e-6), (name, g, step)
                assert _close(s["weights"], weights[g][step], atol=1e-6), (name, g, step + 1)
            assert _close(run["after_exit"], weights[g][STEPS], atol=1e-6), name
        for step in range(STEPS):  # apart between syncs (no gradient average), equal at them
            same = _close(seen[0][step]["weights"], seen[1][step]["weights"], rtol=0, atol=0)
            assert same == ((step + 1) % H == 0), (name, step + 1)
        assert _close(runs[0]["after_exit"], runs[1]["after_exit"], rtol=0, atol=0), name
        first_step += STEPS


def test_a_group_killed_under_diloco_heals_its_step_counts_and_outer_state(
        tmp_path: Path) -> None:
    # group 1 dies after step 4 (its outer optimizer has a momentum from the sync at step 3),
    # restarts and heals: from the peer it receives local_sgd()'s step counts, DiLoCo's global
    # weights and its outer optimizer's state, so every sync after the heal is bit-identical
    # (a fresh outer state would give other weights at every sync, and steps out of phase)
    out = tmp_path / "out"
    out.mkdir()
    script = str(_launcher.SCRIPTS / "local_sgd_heal.py")
    proc, log = _launcher.start(["-n", "1", "--replica-groups", "2", "--max-restarts", "1",
                                 script, str(out), "9", "1", "4"], tmp_path, "heal.log",
                                fork_replica_workers=True)
    code = _launcher.finish(proc, 300)
    text = log.read_text(errors="replace")
    assert code == 0, text[-3000:]
    assert "replica group 1 healed from replica group 0" in text, text[-3000:]
    survivor, healed = (torch.load(out / f"group{g}-rank0.pt") for g in (0, 1))
    assert survivor["restart"] == 0 and healed["restart"] == 1
    by_step = {s["step"]: s for s in survivor["seen"]}
    assert sorted(by_step) == list(range(1, len(by_step) + 1))  # the survivor never stopped
    steps = [s["step"] for s in healed["seen"]]
    first = steps[0]
    # it counts on from its peer's step, healed at a period's start (after a sync)
    assert first > 4 and (first - 1) % H == 0, steps
    assert steps == list(range(first, first + len(steps))), steps
    syncs = 0
    for s in healed["seen"]:
        peer = by_step[s["step"]]
        same = _close(s["weights"], peer["weights"], rtol=0, atol=0)
        assert same == (s["step"] % H == 0), (s["step"], first)  # apart between syncs
        syncs += s["step"] % H == 0
    assert syncs >= 3, steps
    # the event lines count steps (state().step), not synchronisations: it died in the sync
    # after step 6 (the second) and healed where its first step began; the left and joined
    # lines come only where its restart outlasted the lighthouse's 2 s heartbeat
    lines = [line for line in text.splitlines() if line.startswith("accel-ctx: replica group")]
    assert any(line.startswith(f"accel-ctx: replica group 1 healed from replica group 0 at step "
                               f"{first - 1} in ") for line in lines), lines
    for line in lines:
        if " left at step " in line:
            assert line.startswith("accel-ctx: replica group 1 left at step 6 (its part of "
                                   "local_sgd()'s synchronisation 2 failed"), lines
        if " joined at step " in line:
            assert line.startswith(f"accel-ctx: replica group 1 joined at step {first - 1}; 2 "
                                   f"groups train. Its share of the {first - 7} steps taken "
                                   f"without it was not trained ({(first - 7) * 4} samples)."), (
                lines)
