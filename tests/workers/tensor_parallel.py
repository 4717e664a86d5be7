"""Tensor-parallel workers: a GPT-shaped model whose attention splits by heads, trained by the
plain loop under ``sharded(tp=2)`` (4 ranks: 2 data-parallel x 2 tensor-parallel) and
``distributed(tp=2)`` (2 ranks), and the misuses a user can make of ``tp=``.

``train`` is the user's script: it runs unchanged in one process (the reference, batch dp·b)
and on the ranks (batch b). The model is written as tensor parallelism needs it written: the
attention reshapes with ``-1`` heads (each rank holds its share), its LayerNorms, embeddings and
the tied ``lm_head`` stay whole on every rank.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader, TensorDataset

from accel_ctx import (
    accumulate,
    clip_grad_norm_,
    distributed,
    gather,
    gather_for_metrics,
    load_state,
    mixed_precision,
    reduce,
    save_model,
    save_state,
    sharded,
    state,
)
from accel_ctx.errors import ConfigurationError

from .._timeouts import scaled
from .common import by_hand
from .sharded import full_weights, tokens

VOCAB, WIDTH, HEADS, LAYERS, CONTEXT = 32, 16, 4, 2, 8
HEAD_DIM = WIDTH // HEADS

PLAN = {
    "layers.*.attn.q": "colwise", "layers.*.attn.k": "colwise", "layers.*.attn.v": "colwise",
    "layers.*.attn.o": "rowwise", "layers.*.mlp.up": "colwise", "layers.*.mlp.down": "rowwise",
}
# an untied lm_head split on the vocabulary (its output gathered, or kept split by loss_parallel)
LOSS_PLAN = {**PLAN, "lm_head": "colwise_rep"}
# sequence parallel on the norms: the activations between wte and lm_head split along the
# sequence (a model without position embeddings: nothing whole is added to them)
SEQUENCE_PLAN = {**LOSS_PLAN, "wte": "rowwise", "layers.*.ln1": "sequence_parallel",
                 "layers.*.ln2": "sequence_parallel", "ln_f": "sequence_parallel"}
# variant -> (model options, plan, loss_parallel)
VARIANTS: dict[str, tuple[dict[str, bool], dict[str, str], bool]] = {
    "": ({}, PLAN, False), "lp": ({"tied": False}, LOSS_PLAN, True),
    "sp": ({"tied": False, "positions": False}, SEQUENCE_PLAN, False),
    "sp_lp": ({"tied": False, "positions": False}, SEQUENCE_PLAN, True)}


class Attention(nn.Module):
    def __init__(self, heads: int = HEADS) -> None:
        super().__init__()
        self.n_heads = heads
        self.q, self.k, self.v = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.o = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, HEAD_DIM).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class HardCodedAttention(Attention):
    """Reshapes by the model's whole head count: wrong under TP, where a rank holds half."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.n_heads, HEAD_DIM).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class ViewByCountAttention(Attention):
    """nanoGPT's reshape with the head size left to -1: under TP a valid view of the wrong math
    (n_heads heads of head_dim / tp features), refused at the first forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.n_heads, -1).transpose(1, 2)
        k = self.k(x).view(b, t, self.n_heads, -1).transpose(1, 2)
        v = self.v(x).view(b, t, self.n_heads, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).contiguous().view(b, t, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, heads: int = HEADS) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn, self.mlp = Attention(heads), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token and position embeddings, blocks in a ModuleList, lm_head tied to the embedding
    (``tied=False``: its own weight; ``positions=False``: no position embedding)."""

    def __init__(self, heads: int = HEADS, tied: bool = True, positions: bool = True) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(CONTEXT, WIDTH) if positions else None
        self.layers = nn.ModuleList(Block(heads) for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        if tied:
            self.wte.weight = self.lm_head.weight  # tied, as in GPT-2

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.ln_f(x))


@contextlib.contextmanager
def scope(kind: str, k: int = 1, variant: str = "") -> Iterator[None]:
    _, plan, loss = VARIANTS[variant]
    with contextlib.ExitStack() as stack:
        if kind in ("sharded", "distributed"):
            stack.enter_context({"sharded": sharded, "distributed": distributed}[kind](
                tp=2, tp_plan=plan, loss_parallel=loss, timeout=scaled(60)))
        elif kind == "hsdp":  # 8 ranks: 2 copies x 2 shards x 2 tp
            stack.enter_context(sharded(tp=2, tp_plan=plan, shard_size=2, timeout=scaled(60)))
        if k > 1:
            stack.enter_context(accumulate(k))
        yield


def make_optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    """``name``: "sgd" or "adamw", with "-foreach" or "-fused" for those implementations (the
    defaults on CUDA; the CPU's default is the for-loop one)."""
    name, _, how = name.partition("-")
    kind = {"": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[how]
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, **kind)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, **kind)


def train(kind: str, batch: int, *, epochs: int = 1, k: int = 1, clip: float | None = None,
          precision: str = "no", optimizer: str = "sgd", save: str | None = None,
          compiled: str = "", variant: str = "") -> dict[str, Any]:
    """The plain loop, in the scope ``kind`` names ("plain": none); ``save``: save_model there
    after training; ``compiled``: "model" or "blocks" compiled (backend="aot_eager") first;
    ``variant``: the model, plan and loss_parallel of VARIANTS."""
    with scope(kind, k, variant), mixed_precision(precision):
        torch.manual_seed(0)
        model = GPT(**VARIANTS[variant][0])
        for part in {"model": [model], "blocks": model.layers, "": [], "wrapper": []}[compiled]:
            part.compile(backend="aot_eager")
        net = torch.compile(model, backend="aot_eager") if compiled == "wrapper" else model
        torch._dynamo.reset()
        counters.clear()
        computed: set[str] = set()
        # eager runs only: traced by torch.compile, the hook's set became a guard, and the set
        # it had just filled recompiled the block at the second step (a third of the compiled
        # runs' time; they do not read it); the hook still runs there, as a no-op
        model.layers[0].attn.q.register_forward_hook(
            lambda m, args, out: None if torch.compiler.is_compiling()
            else computed.add(str(out.dtype)))
        opt = make_optimizer(model, optimizer)
        loader = DataLoader(tokens(32), batch_size=batch, shuffle=True)
        seen: list[list[int]] = []
        outputs, losses = set(), []
        for _ in range(epochs):
            for x, y in loader:
                seen.append(x[:, 0].tolist())
                logits = net(x)
                outputs.add(type(logits).__name__)  # loss_parallel: a vocabulary-split DTensor
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
                loss.backward()
                losses.append(loss.item())
                if clip is not None:
                    clip_grad_norm_(model.parameters(), clip)
                opt.step()
                opt.zero_grad()
        evaluated, firsts, counted = [], [], 0
        with torch.no_grad():  # gather_for_metrics: each sample once, not once per TP rank
            for x, _ in DataLoader(tokens(10), batch_size=batch):
                evaluated += gather_for_metrics(x[:, 0]).tolist()
            for x, _ in DataLoader(tokens(8), batch_size=batch):  # whole rounds: no padding
                firsts += gather(x[:, 0]).tolist()
                counted += len(x)
        counted = reduce(torch.tensor(counted)).item()  # what the evaluation warning advises
        wide = reduce(torch.ones(64), "mean").sum().item()  # past the header: an all_reduce
        where = state()
        if save is not None:
            save_model(model, save)
        return {"weights": full_weights(model), "seen": seen, "evaluated": evaluated,
                "gathered": firsts, "counted": counted, "wide": wide,
                "where": {k: getattr(where, k) for k in
                          ("rank", "world_size", "dp_rank", "dp_size", "tp_rank", "tp_size")},
                "tied": model.wte.weight is model.lm_head.weight, "computed": sorted(computed),
                "master": sorted({str(p.dtype) for p in model.parameters()}),
                "split": type(model.layers[0].attn.q.weight).__name__,
                "mesh": [(p.device_mesh.mesh_dim_names, [str(x) for x in p.placements])
                         for p in (model.layers[0].attn.q.weight, model.layers[0].ln1.weight)
                         if hasattr(p, "device_mesh")],
                "outputs": sorted(outputs), "losses": losses,
                "graph_breaks": sum(counters["graph_break"].values())}


@contextlib.contextmanager
def _refusal(into: dict[str, str], name: str) -> Iterator[None]:
    try:
        yield
    except ConfigurationError as exc:
        into[name] = str(exc)
    else:
        into[name] = "no error"


def misuse() -> dict[str, str]:
    """Each mistake on 4 ranks: a clear error on every rank, none a hang."""
    said: dict[str, str] = {}
    with _refusal(said, "tp_not_dividing"), sharded(tp=3, tp_plan=PLAN, timeout=scaled(60)):
        pass
    with _refusal(said, "distributed_with_dp"), distributed(tp=2, tp_plan=PLAN,
                                                            timeout=scaled(60)):
        pass
    with sharded(tp=2, timeout=scaled(60)), _refusal(said, "no_plan"):
        GPT()(torch.zeros(2, CONTEXT, dtype=torch.long))
    typo = {**PLAN, "layers.*.attn.qq": "colwise"}
    with sharded(tp=2, tp_plan=typo, timeout=scaled(60)), _refusal(said, "missing_module"):
        GPT()(torch.zeros(2, CONTEXT, dtype=torch.long))
    with sharded(tp=2, tp_plan=PLAN, shard_size=1, timeout=scaled(60)), _refusal(
            said, "hsdp_of_one"):
        GPT()(torch.zeros(2, CONTEXT, dtype=torch.long))
    with sharded(tp=4, tp_plan=PLAN, timeout=scaled(60)), _refusal(said, "heads"):
        GPT(heads=2)(torch.zeros(2, CONTEXT, dtype=torch.long))
    with sharded(tp=2, tp_plan=PLAN, timeout=scaled(60)), _refusal(said, "hard_coded_heads"):
        model = GPT()
        for block in model.layers:
            block.attn = HardCodedAttention()
        model(torch.zeros(2, CONTEXT, dtype=torch.long))
    with sharded(tp=2, tp_plan=PLAN, timeout=scaled(60)), _refusal(said, "view_by_count"):
        model = GPT()
        for block in model.layers:
            block.attn = ViewByCountAttention()
        F.cross_entropy(model(torch.zeros(2, CONTEXT, dtype=torch.long)).flatten(0, 1),
                        torch.zeros(2 * CONTEXT, dtype=torch.long)).backward()
    with sharded(tp=2, tp_plan=PLAN, timeout=scaled(60)):
        model = GPT()
        model(torch.zeros(2, CONTEXT, dtype=torch.long))
        # the first forward's watch is gone: nothing of it on the later steps
        said["hooks_left"] = str(sum(len(b.attn._forward_hooks) + len(b.attn._forward_pre_hooks)
                                     for b in model.layers))
    with sharded(tp=2, timeout=scaled(60)), _refusal(said, "declared_names_none"):
        model = GPT()
        model._tp_plan = {"h.*.attn.c_attn": "colwise"}  # another model's names
        model(torch.zeros(2, CONTEXT, dtype=torch.long))
    # sequence and loss parallelism where they cannot apply: refused, not silently wrong
    untied = {"tied": False, "positions": False}
    for name, plan, loss, options, length in (
            ("sp_tied", SEQUENCE_PLAN, False, {"positions": False}, CONTEXT),
            ("lp_tied", LOSS_PLAN, True, {}, CONTEXT),
            ("sp_odd_length", SEQUENCE_PLAN, False, untied, CONTEXT - 1),
            ("sp_unfed", {k: v for k, v in SEQUENCE_PLAN.items() if k != "layers.*.ln1"}, False,
             untied, CONTEXT)):
        with sharded(tp=2, tp_plan=plan, loss_parallel=loss, timeout=scaled(60)), _refusal(
                said, name):
            GPT(**options)(torch.zeros(2, length, dtype=torch.long))
    return said


def checkpoint_run(ckpt: str, batch: int, *, stop: int | None = None,
                   resume: bool = False) -> dict[str, Any]:
    """The resumable loop under sharded(tp=2): saves at micro-step ``stop``, or resumes."""
    with scope("sharded"):
        torch.manual_seed(0)
        model = GPT()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        loader = DataLoader(tokens(32), batch_size=batch, shuffle=True)
        if resume:
            torch.manual_seed(1234)  # what the process drew before must not matter
            load_state(ckpt, model=model, optimizer=opt, loader=loader)
        loaded = full_weights(model) if resume else None
        for micro, (x, y) in enumerate(loader, 1):
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            opt.step()
            opt.zero_grad()
            if micro == stop:
                save_state(ckpt, model=model, optimizer=opt, loader=loader)
                save_model(model, f"{ckpt}.model.pt")
                break
        return {"weights": full_weights(model), "step": state().step, "loaded": loaded}


def by_hand_recipe(batch: int, bf16: bool = False,
                   loss_parallel: bool = False) -> dict[str, torch.Tensor]:
    """The hand-written recipe sharded(tp=2) stands for, on 4 ranks (torchtitan's order):
    parallelize_module over "tp" with the same plan, fully_shard over "dp" (blocks, then the
    root); data-parallel group d takes the d-th half of each global batch. ``bf16``: as under
    mixed_precision("bf16"): MixedPrecisionPolicy(bf16, fp32 reduce), the forward and the loss
    under torch.autocast. ``loss_parallel``: the untied lm_head's output kept split on the
    vocabulary (ColwiseParallel(use_local_output=False)), the loss and backward under torch's
    loss_parallel()."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from torch.distributed.tensor.parallel import loss_parallel as loss_parallel_on

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    torch.manual_seed(0)
    model = GPT(tied=not loss_parallel)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan: dict[str, Any] = {f"layers.{i}.{path.split('.', 2)[2]}": styles[style]()
                            for i in range(LAYERS) for path, style in PLAN.items()}
    if loss_parallel:
        plan["lm_head"] = ColwiseParallel(use_local_output=False)
    parallelize_module(model, mesh["tp"], plan)
    dtype = torch.bfloat16 if bf16 else None
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if bf16 else None)
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"], mp_policy=policy)
    fully_shard(model, mesh=mesh["dp"], mp_policy=policy)
    opt = make_optimizer(model, "sgd")
    for x, y in DataLoader(tokens(32), batch_size=2 * batch, shuffle=True):
        x, y = x[dp * batch:(dp + 1) * batch], y[dp * batch:(dp + 1) * batch]
        with loss_parallel_on() if loss_parallel else contextlib.nullcontext():
            with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
        opt.step()
        opt.zero_grad()
    weights = full_weights(model)
    del model, opt
    return weights


def compiled_run(batch: int) -> dict[str, Any]:
    """TP under torch.compile: the model compiled in place, its torch.compile wrapper, its
    blocks (backend="aot_eager": Dynamo and AOT autograd as inductor sees them)."""
    return {how: train("sharded", batch, compiled=how) for how in ("model", "wrapper", "blocks")}


def two_ranks(batch: int, root: str, ckpt: str) -> dict[str, Any]:
    """distributed(tp=2) on 2 ranks: the loop, save_model of a TP-only model, and the 2x2
    checkpoint ``ckpt`` (sharded(tp=2) on 4 ranks) loaded resharded onto TP 2 / DP 1."""
    out = {"train": train("distributed", batch, save=f"{root}/tp_only.pt"),
           "sp_lp": train("distributed", batch, variant="sp_lp")}
    # the parameters outside the plan stay plain tensors beside the split ones: the foreach and
    # fused steps (CUDA's defaults) take both kinds in one list
    for name in ("sgd-foreach", "adamw", "adamw-foreach", "adamw-fused"):
        out[name] = train("distributed", batch, optimizer=name)["weights"]
    with scope("distributed"):
        torch.manual_seed(5)  # other weights than the checkpoint's
        model = GPT()
        opt = make_optimizer(model, "sgd")
        load_state(ckpt, model=model, optimizer=opt)
        out["resharded"] = full_weights(model)
        out["resharded_split"] = type(model.layers[0].attn.q.weight).__name__
        x, y = next(iter(DataLoader(tokens(32), batch_size=batch)))
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        out["stepped"] = full_weights(model)
    return out


def on_tp4(ckpt: str) -> dict[str, Any]:
    """The 2x2 checkpoint ``ckpt`` loaded resharded onto TP 4 / DP 1 (distributed(tp=4))."""
    with distributed(tp=4, tp_plan=PLAN, timeout=scaled(60)):
        torch.manual_seed(5)  # other weights than the checkpoint's
        model = GPT()
        opt = make_optimizer(model, "sgd")
        load_state(ckpt, model=model, optimizer=opt)
        q = model.layers[0].attn.q.weight
        return {"weights": full_weights(model), "q_rows": q.to_local().shape[0]}


def has_transformers() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers") is not None


def llama(kv_heads: int = 2) -> nn.Module:
    """transformers' LlamaForCausalLM from a tiny config (no download): GQA, 4 heads, 2 of k/v."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import LlamaConfig, LlamaForCausalLM  # slow: only where a check needs it

    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=kv_heads, vocab_size=128, intermediate_size=128,
                         max_position_embeddings=CONTEXT)
    return LlamaForCausalLM(config)


def train_llama(kind: str, batch: int) -> dict[str, Any]:
    """The plain loop over a transformers Llama, with no tp_plan: the model's own plan splits
    it (q/k/v/gate/up colwise, o/down rowwise, the embedding by vocabulary, lm_head gathered)."""
    with sharded(tp=2, timeout=scaled(60)) if kind == "sharded" else contextlib.nullcontext():
        torch.manual_seed(0)
        model = llama()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses = []
        g = torch.Generator().manual_seed(3)
        data = torch.randint(0, 128, (16, CONTEXT + 1), generator=g)
        loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=batch)
        for x, y in loader:
            loss = F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        attn = model.model.layers[0].self_attn
        return {"losses": losses, "weights": full_weights(model),
                "local": {"q_proj": tuple(_local(attn.q_proj.weight).shape),
                          "k_proj": tuple(_local(attn.k_proj.weight).shape),
                          "embed_tokens": tuple(_local(model.model.embed_tokens.weight).shape)}}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def llama_run(batch: int) -> dict[str, Any] | None:
    """transformers' Llama under sharded(tp=2) with its own plan; a config whose k/v heads
    tp does not divide is refused (its k_proj's 16 rows would split one head in two)."""
    if not has_transformers():
        return None
    said: dict[str, str] = {}
    with sharded(tp=2, timeout=scaled(60)), _refusal(said, "kv_heads"):
        llama(kv_heads=1)(torch.zeros(2, CONTEXT, dtype=torch.long))
    return {"train": train_llama("sharded", batch), "misuse": said}


def loss_parallel_left_on() -> bool:
    """Torch's loss_parallel() ops still swapped in after the scopes closed (they must not be)."""
    from torch.distributed.tensor import DTensor

    return torch.ops.aten._log_softmax.default in DTensor._op_dispatcher._custom_op_handlers


def eight_ranks(batch: int) -> dict[str, Any]:
    """HSDP x TP: sharded(tp=2, shard_size=2) on 8 ranks, a 2 x 2 x 2 mesh."""
    return train("hsdp", batch, clip=0.05)


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.said: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.said.append(record.getMessage())


def four_ranks(batch: int, root: str) -> dict[str, Any]:
    """Everything the 4-rank tests check, in one spawn; and what DTensor's redistribution
    logged over all of it (it warns once a process)."""
    said = _Said()
    logging.getLogger("torch.distributed.tensor._redistribute").addHandler(said)
    return {**_four_ranks(batch, root), "redistribute_said": said.said}


def _four_ranks(batch: int, root: str) -> dict[str, Any]:
    return {"ckpt_full": checkpoint_run(f"{root}/none", batch),
            "ckpt_stop": checkpoint_run(f"{root}/tp", batch, stop=3),
            "ckpt_resume": checkpoint_run(f"{root}/tp", batch, resume=True),
            "ckpt_tp4": on_tp4(f"{root}/tp"),
            "sharded": train("sharded", batch, epochs=2), "misuse": misuse(),
            "clip": train("sharded", batch, clip=0.05),
            "bf16": train("sharded", batch, precision="bf16"), "acc": train("sharded", batch, k=2),
            "adamw": train("sharded", batch, optimizer="adamw"),
            "bf16_by_hand": by_hand(by_hand_recipe, batch, True), "compiled": compiled_run(batch),
            "lp": train("sharded", batch, variant="lp"), "sp": train("sharded", batch, variant="sp"),
            "lp_by_hand": by_hand(by_hand_recipe, batch, False, True),
            "lp_left_on": loss_parallel_left_on(),
            "llama": llama_run(batch)}
