"""sharded() workers: a GPT-shaped model with tied embeddings, trained by the plain loop.

``train`` is the user's script: it runs unchanged in one process (the reference, batch W·b),
under ``distributed()`` (DDP) and under ``sharded()`` (FSDP2) on W ranks with batch b. Each
returns the full weights (gathered inside the scope) and, for the memory check, the bytes of
parameters, gradients and optimizer state this rank holds.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel_ctx import (
    accumulate,
    clip_grad_norm_,
    distributed,
    load_state,
    save_model,
    save_state,
    sharded,
    state,
)

from .._timeouts import scaled

VOCAB, WIDTH, HEADS, LAYERS, CONTEXT = 32, 24, 2, 3, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.ln2 = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    """Token and position embeddings, blocks in a ModuleList, lm_head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(CONTEXT, WIDTH)
        self.h = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight  # tied, as in GPT-2

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def tokens(n: int = 48, seed: int = 5) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, VOCAB, (n, CONTEXT + 1), generator=g)
    return TensorDataset(data[:, :-1], data[:, 1:])


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights on every rank (a collective when it is sharded)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().cpu().clone() for k, v in full.items()}


def local_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Parameter + gradient + optimizer-state bytes this rank holds itself."""
    seen: dict[int, torch.Tensor] = {}
    tensors = [p for p in model.parameters()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        seen[id(local)] = local
    return sum(t.numel() * t.element_size() for t in seen.values())


@contextlib.contextmanager
def scope(kind: str, k: int) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        if kind == "ddp":
            stack.enter_context(distributed(timeout=scaled(60)))
        elif kind == "sharded":
            stack.enter_context(distributed(timeout=scaled(60)))
            stack.enter_context(sharded())
        elif kind == "sharded_alone":
            stack.enter_context(sharded(timeout=scaled(60)))
        if k > 1:
            stack.enter_context(accumulate(k))
        yield


def train(kind: str, batch: int, *, k: int = 1, epochs: int = 2, meta: bool = False,
          frozen: bool = False, clip: float | None = None, opt_after: bool = False,
          momentum: float = 0.9) -> dict[str, Any]:
    """The plain loop, in the scope ``kind`` names ("plain": none)."""
    with scope(kind, k):
        torch.manual_seed(0)
        with torch.device("meta") if meta else contextlib.nullcontext():
            model = GPT()
        if frozen:
            model.wpe.requires_grad_(False)
        make_opt = lambda: torch.optim.SGD(  # noqa: E731
            [p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=momentum)
        opt = None if opt_after else make_opt()
        loader = DataLoader(tokens(), batch_size=batch, shuffle=True)
        for _ in range(epochs):
            for x, y in loader:
                logits = model(x)
                if opt is None:
                    opt = make_opt()
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
                loss.backward()
                if clip is not None:
                    clip_grad_norm_(model.parameters(), clip)
                opt.step()
                opt.zero_grad(set_to_none=False)
        assert opt is not None
        return {"weights": full_weights(model), "bytes": local_bytes(model, opt),
                "class": type(model).__name__, "isinstance": isinstance(model, GPT),
                "keys": sorted(model.state_dict()), "step": state().step,
                "tied": model.wte.weight is model.lm_head.weight,
                "opt_params_are_model_params": {id(p) for g in opt.param_groups
                                                for p in g["params"]}
                <= {id(p) for p in model.parameters()}}


def equivalence(batch: int) -> dict[str, Any]:
    """On W ranks: the same loop under DDP and under sharded(), in several variations."""
    return {
        "ddp": train("ddp", batch),
        "sharded": train("sharded", batch),
        "alone": train("sharded_alone", batch, epochs=1),
        "ddp_acc": train("ddp", batch, k=2),
        "sharded_acc": train("sharded", batch, k=2),
        "opt_after": train("sharded", batch, opt_after=True, epochs=1),
        "meta": train("sharded", batch, meta=True, epochs=1),
        "frozen": train("sharded", batch, frozen=True, epochs=1),
        "clip": train("sharded", batch, clip=0.05, epochs=1),
        "ddp_clip": train("ddp", batch, clip=0.05, epochs=1),
        "world": int(os.environ["WORLD_SIZE"]),
    }


def gan(batch: int, kind: str = "sharded") -> dict[str, Any]:
    """Two models, two optimizers (generator and critic), each stepped on its own loss."""
    with scope(kind, 1):
        torch.manual_seed(0)
        gen = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)))
        critic = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        g_opt = torch.optim.SGD(gen.parameters(), lr=0.05)
        c_opt = torch.optim.SGD(critic.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(3)
        data = TensorDataset(torch.randn(48, 8, generator=g), torch.randn(48, 8, generator=g))
        for noise, real in DataLoader(data, batch_size=batch, shuffle=True):
            c_loss = critic(gen(noise).detach()).mean() - critic(real).mean()
            c_loss.backward()
            c_opt.step()
            c_opt.zero_grad()
            g_loss = -critic(gen(noise)).mean()
            g_loss.backward()
            g_opt.step()
            g_opt.zero_grad()
            c_opt.zero_grad()
        return {"gen": full_weights(gen), "critic": full_weights(critic)}


def checkpoint_run(ckpt: str, kind: str, *, k: int, stop: int | None = None,
                   resume: bool = True, model_file: str | None = None,
                   adam: bool = True) -> dict[str, Any]:
    """The resumable loop: AdamW (or SGD with momentum), shuffled loader, accumulate(k);
    saves at ``stop``. (Adam turns the rounding noise of gradients that are zero in exact
    math, such as the key bias's, into full-size steps: runs that sum in another order are
    compared with SGD.)"""
    with scope(kind, k):
        torch.manual_seed(0)
        model = GPT()
        opt: torch.optim.Optimizer = (
            torch.optim.AdamW(model.parameters(), lr=0.01) if adam
            else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        loader = DataLoader(tokens(), batch_size=2, shuffle=True)
        resumed = load_state(ckpt, model=model, optimizer=opt, loader=loader) if resume else None
        loaded = full_weights(model) if resumed else None
        micro = 0
        for _ in range(resumed.epoch if resumed else 0, 2):
            for x, y in loader:
                F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
                opt.step()
                opt.zero_grad()
                micro += 1
                if stop is not None and micro == stop:
                    save_state(ckpt, model=model, optimizer=opt, loader=loader)
                    return {"weights": full_weights(model), "step": state().step}
        if model_file is not None:
            save_model(model, model_file)
        return {"weights": full_weights(model), "step": state().step, "loaded": loaded,
                "resumed": (resumed.step, resumed.world_size) if resumed else None}


def checkpoint_stops(root: str) -> dict[str, Any]:
    """On 2 ranks: uninterrupted runs and runs stopped mid-epoch, sharded and under DDP."""
    return {
        "full": checkpoint_run(f"{root}/none", "sharded", k=1, resume=False,
                               model_file=f"{root}/model.pt"),
        "stop": checkpoint_run(f"{root}/sharded", "sharded", k=1, stop=5),
        "sgd_full": checkpoint_run(f"{root}/none", "sharded", k=1, resume=False, adam=False),
        "ddp_full": checkpoint_run(f"{root}/none", "ddp", k=1, resume=False, adam=False),
        "ddp_stop": checkpoint_run(f"{root}/ddp", "ddp", k=1, stop=5, adam=False),
        "sgd_stop": checkpoint_run(f"{root}/sgd", "sharded", k=1, stop=5, adam=False),
        # 2 ranks x accumulate(3): 6 loader batches per step, stopped at a step boundary
        "reshard_full": checkpoint_run(f"{root}/none", "sharded", k=3, resume=False,
                                       adam=False),
        "reshard_stop": checkpoint_run(f"{root}/reshard", "sharded", k=3, stop=6, adam=False),
        "mid_group_stop": checkpoint_run(f"{root}/mid", "sharded", k=2, stop=3, adam=False),
    }


def checkpoint_resumes(root: str) -> dict[str, Any]:
    """On 2 ranks, fresh processes: the sharded checkpoint resumed sharded and under DDP, and
    the DDP checkpoint resumed sharded."""
    import warnings

    torch.manual_seed(1234)  # whatever the process did before must not matter
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mid_group = checkpoint_run(f"{root}/mid", "sharded", k=2, adam=False)
    return {
        "mid_group": mid_group, "warnings": [str(w.message) for w in caught],
        "sharded": checkpoint_run(f"{root}/sharded", "sharded", k=1),
        "ddp_to_sharded": checkpoint_run(f"{root}/ddp", "sharded", k=1, adam=False),
        "sharded_to_ddp": checkpoint_run(f"{root}/sgd", "ddp", k=1, adam=False),
    }


def checkpoint_other_world(root: str) -> dict[str, Any]:
    """On 1 or 3 ranks: the 2-rank checkpoint, with the same 6 batches per optimizer step."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return checkpoint_run(f"{root}/reshard", "sharded", k=6 // world, adam=False)


def precision_run(kind: str, precision: str, batch: int) -> dict[str, Any]:
    """One epoch under mixed_precision(precision); what the sharded model computes in."""
    from accel_ctx import mixed_precision

    with scope(kind, 1), mixed_precision(precision, init_scale=2.0**20, growth_interval=2):
        torch.manual_seed(0)
        model = GPT()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses, dtypes = [], set()
        hook = model.h[0].qkv.register_forward_hook(
            lambda m, args, out: dtypes.add(str(m.weight.dtype)))
        for x, y in DataLoader(tokens(), batch_size=batch, shuffle=True):
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
            clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        hook.remove()
        s = state()
        return {"weights": full_weights(model), "losses": losses, "compute": sorted(dtypes),
                "logits": str(logits.dtype), "skipped": s.skipped_steps, "scale": s.loss_scale,
                "master": sorted({str(p.dtype) for p in model.parameters()})}


def options_and_misuse(batch: int) -> dict[str, Any]:
    """sharded()'s options and the mistakes it must name, on W ranks."""
    from accel_ctx import no_sync, on_main_process
    from accel_ctx.errors import AccelCtxError

    out: dict[str, Any] = {}

    def error_of(fn: Any) -> str | None:
        try:
            fn()
        except AccelCtxError as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    # blocks given by class, by predicate, HSDP (one rank per shard group: replicate only)
    for name, options in {"blocks_class": {"blocks": [Block]},
                          "blocks_fn": {"blocks": lambda m: isinstance(m, nn.LayerNorm)},
                          "hsdp": {"shard_size": 1},
                          "keep_gathered": {"reshard_after_forward": False}}.items():
        with distributed(timeout=scaled(60)), sharded(**options):
            torch.manual_seed(0)
            model = GPT()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for x, y in DataLoader(tokens(), batch_size=batch, shuffle=True):
                F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
                opt.step()
                opt.zero_grad()
            from torch.distributed.fsdp import FSDPModule

            out[name] = {"weights": full_weights(model),
                         "units": sorted(n for n, m in model.named_modules()
                                         if isinstance(m, FSDPModule)),
                         "mesh": list(model.wte.weight.device_mesh.shape)}
    # no_sync(): the user's own accumulation, the reduce-scatter once per pair
    with distributed(timeout=scaled(60)), sharded():
        torch.manual_seed(0)
        model = GPT()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        batches = list(DataLoader(tokens(), batch_size=batch, shuffle=True))
        for i, (x, y) in enumerate(batches):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / 2
            if i % 2 == 0:
                with no_sync():
                    loss.backward()
            else:
                loss.backward()
                opt.step()
                opt.zero_grad()
        out["no_sync"] = full_weights(model)
        # rank-only code cannot run a sharded model: it would wait for the other ranks
        out["rank_only"] = error_of(lambda: on_main_process(lambda: model(batches[0][0]))())
    with distributed(timeout=scaled(60)):
        with sharded():
            model = GPT()
            model(batches[0][0]).sum().backward()
        # the sharded() scope closed, the job goes on: the model is still sharded
        with torch.no_grad():
            out["after_sharded_scope"] = error_of(
                lambda: on_main_process(lambda: model(batches[0][0]))())
            out["after_sharded_scope_all"] = tuple(model(batches[0][0]).shape)
        # a model that trains with DDP cannot be sharded in the same job afterwards
    with distributed(timeout=scaled(60)):
        ddp_model = GPT()
        ddp_model(batches[0][0]).sum().backward()
        with sharded():
            out["ddp_then_sharded"] = error_of(lambda: ddp_model(batches[0][0]))

    class Raw(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale

    with distributed(timeout=scaled(60)), sharded():
        with torch.device("meta"):
            raw = Raw()
        out["meta_without_reset"] = error_of(lambda: raw(torch.ones(2, 4)))
    out["cpu_offload_on_cpu"] = None
    with distributed(timeout=scaled(60)), sharded(cpu_offload=True):
        out["cpu_offload_on_cpu"] = error_of(lambda: GPT()(batches[0][0]))
    out["bad_blocks"] = error_of(lambda: sharded(blocks=["Block"]))  # type: ignore[list-item]
    out["bad_shard_size"] = error_of(lambda: sharded(shard_size=0))
    return out
