"""Pipeline-parallel workers: a transformer of 4 blocks trained by the plain loop under
``distributed(pp=2)`` (2 ranks) and ``distributed(pp=2)`` on 2 data-parallel x 2 stages (4),
a checkpoint a pipeline saves, and the misuses a user can make of ``pp=``.

``train`` is the user's script: seed before the scopes, a shuffled loader without a generator,
``clip_grad_norm_`` over ``model.parameters()``, ``loss.item()`` logged after the backward, an
evaluation under ``no_grad`` at the end. One process cutting each batch into the same
micro-batches (``reference``) is what every stage must match.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel_ctx import (
    distributed,
    load_state,
    mixed_precision,
    on_main_process,
    save_model,
    save_state,
    state,
)

from .sequence_parallel import (
    WIDTH,
    Block,  # a transformer block: qkv, causal SDPA, MLP
    _error,  # the message a ConfigurationError gives, or "no error"
)

VOCAB, BLOCKS, LENGTH, SAMPLES = 32, 4, 8, 32


class LM(nn.Module):
    def __init__(self, blocks: int = BLOCKS) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(LENGTH, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.ln_f, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # type: ignore[no-any-return]


def tokens() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (SAMPLES, LENGTH + 1), generator=g)
    return TensorDataset(data[:, :-1], data[:, 1:])


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _loop(model: nn.Module, opt: torch.optim.Optimizer, loader: DataLoader, steps: int | None,
          micro: int, by_hand: bool, clip: float | None) -> list[float]:
    losses: list[float] = []
    for x, y in loader:
        # one process cuts each batch into the pipeline's micro-batches by hand
        out = torch.cat([model(c) for c in x.tensor_split(micro)]) if by_hand else model(x)
        loss = F.cross_entropy(out.flatten(0, 1), y.flatten())
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if steps is not None and len(losses) == steps:
            break
    return losses


def _evaluate(model: nn.Module, micro: int, by_hand: bool) -> float:
    x, y = tokens()[:8]
    with torch.no_grad():
        out = torch.cat([model(c) for c in x.tensor_split(micro)]) if by_hand else model(x)
    return F.cross_entropy(out.flatten(0, 1), y.flatten()).item()


def train(pp: int | None, batch: int, micro: int = 2, epochs: int = 2, clip: float | None = 0.5,
          ckpt: str | None = None, precision: str | None = None,
          steps_per_group: int = 1, then: int = 0) -> dict[str, Any]:
    """The user's script (``pp=None``: one process, the batch cut by hand into ``micro``)."""
    from accel_ctx import accumulate

    torch.manual_seed(0)
    scope = distributed(pp=pp, microbatches=micro) if pp else contextlib.nullcontext()
    amp = mixed_precision(precision) if precision else contextlib.nullcontext()
    with scope, amp, accumulate(steps_per_group):
        model = LM()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = DataLoader(tokens(), batch_size=batch, shuffle=True)
        losses: list[float] = []
        for _ in range(epochs):
            losses += _loop(model, opt, loader, None, micro, pp is None, clip)
        if ckpt is not None:
            save_state(ckpt, model=model, optimizer=opt)
            save_model(model, f"{ckpt}-model.pt")  # the whole model's weights, in one file
        evaluated = _evaluate(model, micro, pp is None)
        where = {"dp": state().dp_size, "pp": state().pp_size, "pp_rank": state().pp_rank}
        out = {"losses": losses, "weights": weights(model), "eval": evaluated, "where": where,
               "params": sum(p.numel() for p in opt.param_groups[0]["params"])}
        if then:  # the run goes on as resume() does from the checkpoint: never stopped
            loader = DataLoader(tokens(), batch_size=batch, shuffle=False)
            out["then"] = {"losses": _loop(model, opt, loader, then, micro, pp is None, 0.5),
                           "weights": weights(model)}
        return out


def ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def train_scheduled(schedule: str, batch: int, micro: int = 4, epochs: int = 1,
                    clip: float | None = 0.5) -> dict[str, Any]:
    """The loop a schedule that computes the loss takes: ``loss = model(x, target=y)``."""
    torch.manual_seed(0)
    with distributed(pp=2, microbatches=micro, schedule=schedule, loss_fn=ce):
        model = LM()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = DataLoader(tokens(), batch_size=batch, shuffle=True)
        losses: list[float] = []
        for _ in range(epochs):
            for x, y in loader:
                loss = model(x, target=y)  # the forwards and backwards, in the schedule's order
                loss.backward()  # nothing left to do: the loop stays as it was
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        x, y = tokens()[:8]
        with torch.no_grad():
            evaluated = model(x, target=y).item()
        return {"losses": losses, "weights": weights(model), "eval": evaluated}


def resume(ckpt: str, pp: int | None, batch: int, micro: int = 2, steps: int = 4) -> dict[str, Any]:
    """Load what a pipeline saved (into one process, or a pipeline) and train on from it."""
    torch.manual_seed(1)
    scope = distributed(pp=pp, microbatches=micro) if pp else contextlib.nullcontext()
    with scope:
        model = LM()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        load_state(ckpt, model=model, optimizer=opt)
        loaded = weights(model)
        loader = DataLoader(tokens(), batch_size=batch, shuffle=False)
        losses = _loop(model, opt, loader, steps, micro, pp is None, 0.5)
        return {"loaded": loaded, "losses": losses, "weights": weights(model),
                "moments": {k: v.clone() for k, v in _moments(model, opt).items()}}


def _moments(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: s["exp_avg"] for p, s in opt.state.items()}


def _first_step(model: nn.Module, twice: bool = False, **call: Any) -> None:
    with distributed(pp=2):
        x = torch.randint(0, VOCAB, (4, LENGTH))
        out = model(x, **call)
        if twice:
            out = out + model(x)
        out.float().mean().backward()


class Tied(LM):
    def __init__(self) -> None:
        super().__init__()
        self.head.weight = self.wte.weight


class Skip(LM):
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        e = self.wte(idx)
        x = e
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x + e))  # type: ignore[no-any-return]


class RootParam(LM):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(WIDTH))


class NoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))  # type: ignore[no-any-return]


class DictOut(LM):
    def forward(self, idx: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return {"logits": super().forward(idx)}


def misuses() -> dict[str, str]:
    """Each loop shape a pipeline cannot run, and the message it gets (on every stage)."""
    out = {
        "tied": _error(lambda: _first_step(Tied())),
        "skip": _error(lambda: _first_step(Skip())),
        "root_param": _error(lambda: _first_step(RootParam())),
        "no_blocks": _error(lambda: _first_step(NoBlocks())),
        "too_few_blocks": _error(lambda: _first_step(LM(blocks=1))),
        "dict_output": _error(lambda: _first_step(DictOut())),
        "two_forwards": _error(lambda: _first_step(LM(), twice=True)),
    }

    @on_main_process
    def preview(model: nn.Module) -> None:
        model(torch.randint(0, VOCAB, (2, LENGTH)))

    def rank_only() -> None:
        with distributed(pp=2):
            model = LM()
            model(torch.randint(0, VOCAB, (2, LENGTH))).sum().backward()
            preview(model)

    out["rank_only"] = _error(rank_only)

    def pp3() -> None:
        with distributed(pp=3):
            pass

    def nested() -> None:
        with distributed(pp=2), distributed(pp=1):
            pass

    def compiled() -> None:
        _first_step(torch.compile(LM()))

    def no_batch() -> None:
        with distributed(pp=2):
            LM()(idx=[1, 2, 3])

    def local_sgd_inside() -> None:
        from accel_ctx import local_sgd

        with distributed(pp=2), local_sgd(every=2):
            pass

    def own_sampler() -> None:  # kept from a DDP script: one share per rank, not per pipeline
        from torch.utils.data import DistributedSampler

        with distributed(pp=2):
            data = tokens()
            next(iter(DataLoader(data, batch_size=4, sampler=DistributedSampler(data))))

    def fp16() -> None:
        with distributed(pp=2), mixed_precision("fp16"):
            LM()(torch.randint(0, VOCAB, (4, LENGTH))).float().mean().backward()

    out.update(fp16=_error(fp16), own_sampler=_error(own_sampler), pp3=_error(pp3), nested=_error(nested), compiled=_error(compiled),
               no_batch=_error(no_batch), local_sgd=_error(local_sgd_inside),
               after_called_before=_error(lambda: _first_step(EmbedAfter())),
               skipped_block=_error(lambda: _first_step(SkipsLast())))
    return out


class EmbedAfter(LM):
    """The embedding registered after the blocks (so given to the last stage), used first."""

    def __init__(self) -> None:
        super().__init__()
        wte = self.wte
        del self.wte
        self.wte = wte


class SkipsLast(LM):
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks[:1]:
            x = block(x)
        return self.head(self.ln_f(x))  # type: ignore[no-any-return]


@distributed(pp=2, microbatches=2)
def decorated() -> dict[str, Any]:
    """The decorator form: the whole function is the scope."""
    torch.manual_seed(0)
    model = LM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = _loop(model, opt, DataLoader(tokens(), batch_size=4, shuffle=True), None, 2,
                   False, 0.5)
    return {"losses": losses, "weights": weights(model)}


def two_ranks(root: str) -> dict[str, Any]:
    """pp=2 on 2 ranks: the plain loop, bf16, a checkpoint, the misuses."""
    out = {
        "plain": train(2, 4, ckpt=f"{root}/ckpt", then=4),
        "micro4": train(2, 4, micro=4, epochs=1),
        "uneven": train(2, 3, micro=2, epochs=1, clip=None),  # 3 rows: 2 + 1, a tail of 2
        "bf16": train(2, 4, epochs=1, precision="bf16"),
        "accumulate": train(2, 2, epochs=1, steps_per_group=2),
        "decorated": decorated(),
        "1f1b": train_scheduled("1f1b", 4),
        "gpipe_scheduled": train_scheduled("gpipe", 4),
        "1f1b_misuses": scheduled_misuses(),
        "misuses": misuses(),
    }
    out["resumed"] = resume(f"{root}/ckpt", 2, 4)
    return out


def scheduled_misuses() -> dict[str, str]:
    """What a schedule that runs the backward inside the call cannot take."""
    from accel_ctx import accumulate

    def without_target() -> None:
        with distributed(pp=2, schedule="1f1b", loss_fn=ce):
            LM()(torch.randint(0, VOCAB, (4, LENGTH)))

    def accumulated() -> None:
        with distributed(pp=2, schedule="1f1b", loss_fn=ce), accumulate(2):
            x = torch.randint(0, VOCAB, (4, LENGTH))
            LM()(x, target=x)

    def fp16() -> None:
        with distributed(pp=2, schedule="1f1b", loss_fn=ce), mixed_precision("fp16"):
            x = torch.randint(0, VOCAB, (4, LENGTH))
            LM()(x, target=x)

    return {"without_target": _error(without_target), "accumulated": _error(accumulated),
            "fp16": _error(fp16)}


def four_ranks() -> dict[str, Any]:
    """dp x pp = 2 x 2: DDP over the data-parallel ranks of each stage."""
    return {"plain": train(2, 2), "1f1b": train_scheduled("1f1b", 2),
            "pp4": train(4, 4, micro=4, epochs=1)}  # two middle stages: received and sent
