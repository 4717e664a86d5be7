"""Workers of tests/sharded/test_deepspeed.py: one plain loop under distributed(), under
sharded(engine="deepspeed") and under DeepSpeed written by hand, on the same ranks.

The loop is the one real scripts write: the seed set before the scopes, the model and its
AdamW built inside them, a shuffled DataLoader without a generator, dropout, the loop's own
clip (or none), an LR scheduler, an evaluation at the end.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

BATCH = 4


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 32),
                         nn.ReLU(), nn.Linear(32, 4))


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 8, generator=g)
    return TensorDataset(x, x[:, :4] * 3.0 + torch.randn(64, 4, generator=g))


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}


def train(kind: str, *, stage: int = 2, clip: float | None = None, k: int = 1,
          offload: str | None = None, config: Any = None, bf16: bool = False,
          epochs: int = 2, save: str | None = None, shuffle: bool = True, schedule: bool = True,
          touch: bool = False) -> dict[str, Any]:
    """The plain loop; ``kind``: "ddp" (distributed()) or "zero" (sharded(engine=...))."""
    from accel_ctx import accumulate, distributed, mixed_precision, save_model, sharded

    torch.manual_seed(0)
    scopes = contextlib.ExitStack()
    with scopes:
        scopes.enter_context(distributed())
        if kind == "zero":
            scopes.enter_context(sharded(engine="deepspeed", stage=stage, offload=offload,
                                         config=config))
        if k > 1:
            scopes.enter_context(accumulate(k))
        if bf16:
            scopes.enter_context(mixed_precision("bf16"))
        model = _model()
        if touch:  # what scripts do before the first forward: count, load, move, set the mode
            assert sum(p.numel() for p in model.parameters()) == 1476
            model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
            model.to("cpu").train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        norms = []
        losses = []
        for _ in range(epochs):
            for x, y in DataLoader(_data(), batch_size=BATCH, shuffle=shuffle):
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                norm = (torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                        if clip is not None else None)
                opt.step()
                if schedule:
                    sched.step()
                opt.zero_grad()
                losses.append(loss.item())
                if norm is not None:
                    norms.append(float(norm))
        model.eval()
        with torch.no_grad():
            x, y = _data().tensors
            eval_loss = nn.functional.mse_loss(model(x), y).item()
        out: dict[str, Any] = {"losses": losses, "norms": norms, "eval": eval_loss,
                               "lr": sched.get_last_lr()[0]}
        if save is not None:
            path = save_model(model, save)
            out["saved"] = {k: v.float() for k, v in torch.load(path).items()}
        else:
            out["weights"] = _weights(model)
    return out


def by_hand(*, stage: int, k: int, epochs: int = 2) -> dict[str, Any]:
    """DeepSpeed as its docs write it: engine(x), engine.backward(loss), engine.step(), with
    its own accumulation (gradient_accumulation_steps=k), no clipping (DeepSpeed's default
    gradient_clipping is 1.0: a config written for a loop that does not clip says 0)."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import groups

    from .common import hand_group

    torch.manual_seed(0)
    with hand_group("deepspeed"):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": k,
                  "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
                  "gradient_clipping": 0.0,
                  "steps_per_print": 2**62}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        # each rank's whole batches in turn, as distributed() shards an unshuffled loader
        rank, world = dist.get_rank(), dist.get_world_size()
        batches = range(rank, len(_data()) // BATCH, world)
        mine = [i for b in batches for i in range(b * BATCH, (b + 1) * BATCH)]
        losses = []
        for _ in range(epochs):
            for x, y in DataLoader(_data(), batch_size=BATCH, sampler=mine):
                loss = nn.functional.mse_loss(engine(x), y)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        groups._release_process_group_references(None)  # as deepspeed.comm's teardown
        return {"losses": losses, "weights": _weights(model)}


def equivalence(tmp: str) -> dict[str, Any]:
    """On 2 ranks: each variation of the loop, as the test compares them."""
    cfg_path = Path(tmp) / f"ds_config_{os.environ['RANK']}.json"
    cfg_path.write_text('{"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",'
                        ' "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",'
                        ' "zero_optimization": {"stage": "auto", "overlap_comm": "auto"},'
                        ' "bf16": {"enabled": "auto"}}')
    saved = str(Path(tmp) / "zero3.pt")
    return {
        "ddp": train("ddp"),
        "zero1": train("zero", stage=1),
        "zero2": train("zero", stage=2),
        "zero3": train("zero", stage=3, save=saved),
        "ddp_saved": train("ddp", save=str(Path(tmp) / "ddp.pt")),
        "zero2_touched": train("zero", stage=2, touch=True),
        "zero3_touched": train("zero", stage=3, touch=True, save=str(Path(tmp) / "z3t.pt")),
        "ddp_clip": train("ddp", clip=0.5),
        "zero2_clip": train("zero", stage=2, clip=0.5),
        "zero1_clip": train("zero", stage=1, clip=0.5),
        "zero2_offload": train("zero", stage=2, offload="cpu"),
        "zero2_hf": train("zero", stage=2, config=str(cfg_path)),
        "ddp_acc": train("ddp", k=2),
        "zero1_acc": train("zero", stage=1, k=2),
        "zero2_offload_acc": train("zero", stage=2, k=2, offload="cpu"),
        "ddp_bf16": train("ddp", bf16=True, epochs=1),
        "zero2_bf16": train("zero", stage=2, bf16=True, epochs=1),
    }


def hand_accumulation() -> dict[str, Any]:
    """accumulate(2) under ZeRO-1/2/3 beside DeepSpeed's own accumulation, written by hand."""
    return {stage: {"ours": train("zero", stage=stage, k=2, shuffle=False, schedule=False),
                    "hand": by_hand(stage=stage, k=2)} for stage in (1, 2, 3)}


def refusals() -> dict[str, str]:
    """What each misuse says, on every rank (each inside a scope of its own)."""
    from accel_ctx import distributed, sharded

    said: dict[str, str] = {}

    def record(name: str, fn: Any) -> None:
        try:
            fn()
        except Exception as exc:  # the message is the assertion
            said[name] = f"{type(exc).__name__}: {exc}"
        else:
            said[name] = "no error"

    def no_optimizer() -> None:
        with distributed(), sharded(engine="deepspeed"):
            model = _model()
            model(torch.randn(2, 8)).sum().backward()

    def two_optimizers() -> None:
        with distributed(), sharded(engine="deepspeed"):
            model = _model()
            sgd = torch.optim.SGD(model.parameters(), lr=0.1)
            adamw = torch.optim.AdamW(model.parameters(), lr=0.1)
            model(torch.randn(2, 8)).sum()
            del sgd, adamw

    def contradicting_accumulation() -> None:
        from accel_ctx import accumulate

        config = {"gradient_accumulation_steps": 4}
        with distributed(), sharded(engine="deepspeed", config=config), accumulate(2):
            model = _model()
            opt = torch.optim.AdamW(model.parameters(), lr=0.1)
            model(torch.randn(2, 8)).sum()
            del opt

    def config_clips_loop_does_not() -> None:
        with distributed(), sharded(engine="deepspeed", config={"gradient_clipping": 1.0}):
            model = _model()
            opt = torch.optim.AdamW(model.parameters(), lr=0.1)
            model(torch.randn(2, 8)).sum().backward()
            opt.step()

    def value_clip() -> None:
        with distributed(), sharded(engine="deepspeed"):
            model = _model()
            opt = torch.optim.AdamW(model.parameters(), lr=0.1)
            model(torch.randn(2, 8)).sum().backward()
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.1)
            opt.step()

    def first_call_under(policy: str) -> Callable[[], None]:
        def scenario() -> None:
            from accel_ctx import mixed_precision

            with distributed(), sharded(engine="deepspeed"), mixed_precision(policy):
                model = _model()
                opt = torch.optim.AdamW(model.parameters(), lr=0.1)
                model(torch.randn(2, 8)).sum().backward()
                del opt

        return scenario

    def rank_only_zero3() -> None:
        from accel_ctx import on_main_process

        with distributed(), sharded(engine="deepspeed", stage=3):
            model = _model()
            opt = torch.optim.AdamW(model.parameters(), lr=0.1)
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            on_main_process(lambda: model(torch.randn(2, 8)))()

    def tensor_parallel() -> None:
        with distributed(tp=2), sharded(engine="deepspeed"):
            pass

    def norm_type() -> None:
        with distributed(), sharded(engine="deepspeed"):
            model = _model()
            opt = torch.optim.AdamW(model.parameters(), lr=0.1)
            model(torch.randn(2, 8)).sum().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=1.0)
            opt.step()

    for name, fn in [("no_optimizer", no_optimizer), ("two_optimizers", two_optimizers),
                     ("contradicting_accumulation", contradicting_accumulation),
                     ("config_clips_loop_does_not", config_clips_loop_does_not),
                     ("value_clip", value_clip), ("fp16", first_call_under("fp16")),
                     ("true_half", first_call_under("bf16-true")),
                     ("rank_only_zero3", rank_only_zero3), ("tensor_parallel", tensor_parallel),
                     ("norm_type", norm_type)]:
        record(name, fn)
    return said


def _checkpointed_objects() -> tuple[nn.Module, torch.optim.Optimizer, Any, DataLoader[Any]]:
    """What the checkpoint loops save and load: the model, AdamW, StepLR, a shuffled loader."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, sched, DataLoader(_data(), batch_size=BATCH, shuffle=True)


def _ckpt_loop(stage: int, offload: str | None, folder: str, phase: str) -> dict[str, Any]:
    """Two epochs straight ("whole"), or the first with a save_state at its end ("first") and
    the second after load_state in fresh processes ("second")."""
    from accel_ctx import distributed, load_state, save_state, sharded

    torch.manual_seed(0)
    with distributed(), sharded(engine="deepspeed", stage=stage, offload=offload):
        model, opt, sched, loader = _checkpointed_objects()
        epochs = range(2)
        if phase == "second":
            load_state(folder, model=model, optimizer=opt, scheduler=sched, loader=loader)
            epochs = range(1, 2)
        elif phase == "first":
            epochs = range(1)
        losses = []
        for _ in epochs:
            for x, y in loader:
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
                sched.step()
                opt.zero_grad()
                losses.append(loss.item())
        if phase == "first":
            save_state(folder, model=model, optimizer=opt, scheduler=sched, loader=loader)
        return {"losses": losses, "weights": model_state_of(model)}


def model_state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every weight whole (ZeRO-3's gathered by DeepSpeed), on every rank."""
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for name, param in model.named_parameters():
        full = safe_get_full_fp32_param(param)
        out[name] = (full if full is not None else param).detach().clone()
    return out


CHECKPOINTED = ((1, None), (2, None), (3, None), (2, "cpu"))


def checkpoint_phase(root: str, phase: str) -> dict[str, Any]:
    """One phase of the save, restart, load runs, for every stage (each phase its own
    processes: the second starts from the checkpoint alone)."""
    out = {f"{stage}-{offload}": _ckpt_loop(stage, offload, f"{root}/{stage}-{offload}", phase)
           for stage, offload in CHECKPOINTED}
    if phase == "second":
        out["zero3_into_ddp"] = _load_under_ddp(f"{root}/3-None")
    return out


def _load_under_ddp(folder: str) -> dict[str, Any]:
    """The same loop under distributed() alone loading what ZeRO-3 saved: one format."""
    from accel_ctx import distributed, load_state

    with distributed():
        model, opt, sched, loader = _checkpointed_objects()
        load_state(folder, model=model, optimizer=opt, scheduler=sched, loader=loader)
        steps = [float(s["step"]) for s in opt.state_dict()["state"].values()]
        return {"weights": _weights(model), "steps": steps, "lr": sched.get_last_lr()}


class _Killed(Exception):
    pass


def resumable_phase(root: str, phase: str) -> dict[str, Any]:
    """``resumable(every_steps=4)`` around ZeRO-2 and ZeRO-3: the whole run ("whole"), a run
    stopped at step 10 ("first"), and the same script started again ("second")."""
    from accel_ctx import distributed, resumable, sharded

    out = {}
    for stage in (2, 3):
        torch.manual_seed(0)
        losses: list[float] = []
        try:
            with resumable(f"{root}/{stage}", every_steps=4) as run, distributed(), \
                    sharded(engine="deepspeed", stage=stage):
                model = _model()
                opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
                for _ in run.epochs(2):
                    for x, y in DataLoader(_data(), batch_size=BATCH, shuffle=True):
                        loss = nn.functional.mse_loss(model(x), y)
                        loss.backward()
                        opt.step()
                        opt.zero_grad()
                        losses.append(loss.item())
                        if phase == "first" and run.step == 10:
                            raise _Killed
                weights = model_state_of(model)
                step = run.step
        except _Killed:
            weights, step = {}, 10
        out[stage] = {"losses": losses, "weights": weights, "step": step}
    return out


def stalled_under_deepspeed(folder: str, stage: int) -> tuple[str, str, Any, float]:
    """Rank 1 stalls in its forward at step 3 under ZeRO-``stage``: the others must give up
    within distributed()'s timeout (DeepSpeed's own collectives too) and name it."""
    from accel_ctx import distributed, sharded

    from .._timeouts import scaled
    from .blame_trust import STALL_TIMEOUT, Sleepy, _attempt, _train

    flag = Path(folder) / f"gave-up-{stage}"

    def scenario() -> None:
        try:
            with distributed(timeout=scaled(STALL_TIMEOUT)), sharded(engine="deepspeed",
                                                                      stage=stage):
                torch.manual_seed(0)
                _train(Sleepy(flag, 1, 3), 6)
        finally:
            if os.environ["RANK"] != "1":
                flag.touch()  # the stalled rank may go on now

    return _attempt(scenario)
