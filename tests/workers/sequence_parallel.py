"""Sequence-parallel (Ulysses) workers: a small causal transformer that takes ``position_ids``,
trained by the plain loop under ``distributed(sp=2)`` (2 ranks), ``distributed(sp=2)`` and
``sharded(sp=2)`` on 2 data-parallel x 2 sequence-parallel ranks (4), an HF GPT-2 the same,
and the misuses a user can make of ``sp=``.

``train`` is the user's script: seed before the scopes, a shuffled loader without a generator,
labels with some -100, ``loss.item()`` logged after the backward. One process (batch dp·b) is
the reference; the ranks get batch b, each its slice of every sequence.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from accel_ctx import (
    accumulate,
    distributed,
    load_state,
    mixed_precision,
    reduce,
    save_state,
    sharded,
    state,
)
from accel_ctx.errors import ConfigurationError

VOCAB, WIDTH, HEADS, LAYERS, LENGTH, SAMPLES = 32, 16, 4, 2, 16, 16


class Block(nn.Module):
    def __init__(self, heads: int = HEADS) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        # no bias on qkv: the key bias has no gradient (softmax ignores it), only float noise
        # that AdamW would scale up to whole steps, differently in any other summation order
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH, bias=False), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (p.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for p in self.qkv(self.ln1(x)).split(c, 2))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """Learned positions from ``position_ids`` (or 0..T-1 when none are given)."""

    def __init__(self, heads: int = HEADS) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(LENGTH, WIDTH)
        self.blocks = nn.ModuleList(Block(heads) for _ in range(LAYERS))
        self.ln_f, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1]).unsqueeze(0)
        x = self.wte(input_ids) + self.wpe(position_ids)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))  # type: ignore[no-any-return]


class NanoLM(TinyLM):
    """nanoGPT's shape: positions from the input's own length, no position_ids argument."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(idx)


class EagerLM(TinyLM):
    """Attention written by hand (HF's "eager"): no scaled_dot_product_attention call."""

    def __init__(self) -> None:
        super().__init__()
        for block in self.blocks:
            block.forward = self._eager(block)  # type: ignore[method-assign]

    @staticmethod
    def _eager(block: Block) -> Any:
        def forward(x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
            q, k, v = block.qkv(block.ln1(x)).split(x.shape[-1], 2)
            y = torch.softmax(q @ k.transpose(1, 2) / WIDTH ** 0.5, -1) @ v
            return x + block.proj(y)
        return forward


class Flat(nn.Module):
    """SDPA on a 3-D query (no batch dimension)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)

    def forward(self, input_ids: torch.Tensor, position_ids: Any = None) -> torch.Tensor:
        x = self.wte(input_ids[0]).unsqueeze(0)  # (1, T, C): heads 1, as (heads, T, C)
        return F.scaled_dot_product_attention(x, x, x, is_causal=True)


class OneKV(TinyLM):
    """Grouped-query attention with one key/value head (4 query heads)."""

    def forward(self, input_ids: torch.Tensor, position_ids: Any = None,
                mask: Any = None) -> torch.Tensor:
        x = self.wte(input_ids)
        b, t, c = x.shape
        q = x.view(b, t, HEADS, c // HEADS).transpose(1, 2)
        kv = x[..., : c // HEADS].unsqueeze(1)
        return F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)


class Tokens(Dataset[Any]):
    """Next-token pairs, labels already shifted (a third of them -100), in dicts (or tuples)."""

    def __init__(self, length: int = LENGTH, as_tuples: bool = False) -> None:
        g = torch.Generator().manual_seed(7)
        seq = torch.randint(0, VOCAB, (SAMPLES, length + 1), generator=g)
        self.ids, self.labels = seq[:, :-1], seq[:, 1:].clone()
        self.labels[torch.rand(self.labels.shape, generator=g) < 0.35] = -100
        self.as_tuples = as_tuples

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> Any:
        if self.as_tuples:
            return self.ids[i], self.labels[i]
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def _scopes(kind: str, sp: int, precision: str | None = None
            ) -> contextlib.AbstractContextManager[Any]:
    stack = contextlib.ExitStack()
    if kind == "sharded":
        stack.enter_context(sharded(sp=sp))
    elif kind == "distributed":
        stack.enter_context(distributed(sp=sp))
    elif kind == "cp":  # ring attention: CUDA
        stack.enter_context(distributed(cp=sp))
    if precision is not None:
        stack.enter_context(mixed_precision(precision))
    return stack


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone()
            for k, v in model.state_dict().items()}


def _loop(model: nn.Module, loader: DataLoader[Any], epochs: int,
          whole_positions: bool = False) -> tuple[list[float], Any]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses: list[float] = []
    for _ in range(epochs):
        for b in loader:
            ids, labels = (b["input_ids"], b["labels"]) if isinstance(b, dict) else b
            extra = ({"position_ids": torch.arange(LENGTH).unsqueeze(0)}
                     if whole_positions else {})
            logits = model(ids, **extra)
            loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses, opt


def train(kind: str, batch: int, sp: int = 2, steps_per_group: int = 1, epochs: int = 2,
          ckpt: str | None = None, as_tuples: bool = False, whole_positions: bool = False,
          precision: str | None = None) -> dict[str, Any]:
    """The user's script; ``kind``: "one" (no scope), "distributed" or "sharded"."""
    torch.manual_seed(0)
    with _scopes(kind, sp, precision), accumulate(steps_per_group):
        model = TinyLM()
        loader = DataLoader(Tokens(as_tuples=as_tuples), batch_size=batch, shuffle=True)
        losses, opt = _loop(model, loader, epochs, whole_positions)
        if ckpt is not None:
            save_state(ckpt, model=model, optimizer=opt)
        where = {"dp": state().dp_size, "sp": state().sp_size, "sp_rank": state().sp_rank}
        mean_loss = reduce(torch.tensor(losses[-1]), "mean").item()
        weights = _weights(model)
    return {"losses": losses, "weights": weights, "where": where, "mean_loss": mean_loss}


@distributed(sp=2)
def decorated() -> dict[str, Any]:
    """The decorator form: the whole function is the scope."""
    torch.manual_seed(0)
    model = TinyLM()
    losses, _ = _loop(model, DataLoader(Tokens(), batch_size=4, shuffle=True), 2)
    return {"losses": losses, "weights": _weights(model)}


def _error(fn: Any) -> str:
    try:
        fn()
    except ConfigurationError as exc:
        return str(exc)
    return "no error"


def _first_step(model: nn.Module, length: int = LENGTH, by_hand: bool = False,
                derived: bool = False, **call: Any) -> None:
    with distributed(sp=2):
        b = next(iter(DataLoader(Tokens(length), batch_size=2)))
        ids = b["input_ids"]
        if by_hand:
            ids = torch.randint(0, VOCAB, (2, LENGTH))
        if derived:
            ids = ids[:, :-1]
        model(ids, **call).sum().backward()


def _nested() -> None:
    with distributed(sp=2), distributed(sp=1):
        pass


def _local_sgd() -> None:
    from accel_ctx import local_sgd

    with distributed(sp=2), local_sgd(every=2):
        pass


def misuses() -> dict[str, str]:
    """Each misuse of sp= on 2 ranks, and the message it ends with."""
    causal = torch.ones(LENGTH // 2, LENGTH // 2, dtype=torch.bool).tril()
    return {
        "nano": _error(lambda: _first_step(NanoLM())),
        "eager": _error(lambda: _first_step(EagerLM())),
        "heads": _error(lambda: _first_step(TinyLM(heads=1))),
        "kv_heads": _error(lambda: _first_step(OneKV())),
        "flat": _error(lambda: _first_step(Flat())),
        "length": _error(lambda: _first_step(TinyLM(), length=LENGTH - 1)),
        "mask": _error(lambda: _first_step(TinyLM(), mask=causal)),
        "by_hand": _error(lambda: _first_step(TinyLM(), by_hand=True)),
        "derived": _error(lambda: _first_step(TinyLM(), derived=True)),
        "local_positions": _error(lambda: _first_step(
            TinyLM(), position_ids=torch.arange(LENGTH // 2).unsqueeze(0))),
        "sp3": _error(lambda: distributed(sp=3).__enter__()),
        "nested": _error(_nested),
        "local_sgd": _error(_local_sgd),
        "deepspeed": _error(lambda: sharded(engine="deepspeed", sp=2).__enter__()),
    }


def two_ranks(root: str) -> dict[str, Any]:
    """sp=2 on 2 ranks: the plain loop and its variants, a checkpoint, the misuses."""
    out = {
        "plain": train("distributed", 4, ckpt=f"{root}/ckpt"),
        "accumulate": train("distributed", 2, steps_per_group=2),
        "tuples": train("distributed", 4, as_tuples=True, epochs=1),
        "whole_positions": train("distributed", 4, whole_positions=True, epochs=1),
        "bf16": train("distributed", 4, precision="bf16", epochs=1),
        "decorated": decorated(),
        "misuses": misuses(),
    }
    with distributed():  # what sp=2 saved, loaded on 2 data-parallel ranks without sp
        out["loaded"] = load_into(root)
    return out


def four_ranks() -> dict[str, Any]:
    """dp x sp = 2 x 2: DDP and FSDP2 over every rank."""
    return {"distributed": train("distributed", 2), "sharded": train("sharded", 2)}


def load_into(root: str) -> dict[str, torch.Tensor]:
    """What sp=2 saved, loaded into a model of this process's scope (or of none)."""
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    load_state(f"{root}/ckpt", model=model, optimizer=opt)
    return _weights(model)


def hf_model(name: str) -> nn.Module:
    """A transformers causal LM from a tiny config (no download), SDPA attention."""
    import os

    os.environ["HF_HUB_OFFLINE"] = "1"
    import transformers  # slow: only where a check needs it

    if name == "gpt2":
        config: Any = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=LENGTH, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel._from_config(config, attn_implementation="sdpa")  # type: ignore[no-any-return]
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=LENGTH)
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")  # type: ignore[no-any-return]


class HFTokens(Tokens):
    """HF's convention: labels are the input ids (the model shifts them), some -100."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(8)
        self.labels = self.ids.clone()
        self.labels[torch.rand(self.labels.shape, generator=g) < 0.35] = -100


def train_hf(name: str, kind: str, batch: int) -> dict[str, Any]:
    """The plain HF loop: ``model(**batch).loss``, the model's own label shift and loss."""
    torch.manual_seed(0)
    losses: list[float] = []
    with _scopes(kind, 2):
        model = hf_model(name)  # SGD: GPT-2's key bias gets float noise for a gradient (see Block)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for b in DataLoader(HFTokens(), batch_size=batch, shuffle=True):
            loss = model(**b).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        weights = _weights(model)
    return {"losses": losses, "weights": weights}


def hf_two_ranks() -> dict[str, Any]:
    return {name: train_hf(name, "distributed", 4) for name in ("gpt2", "llama")}


def compiled() -> dict[str, Any]:
    """A model compiled inside sp=2: the losses, and Dynamo's graph breaks."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    with distributed(sp=2):
        model = TinyLM()
        step = torch.compile(model)
        losses, _ = _loop(step, DataLoader(Tokens(), batch_size=4, shuffle=True), 1)
    return {"losses": losses, "breaks": dict(counters["graph_break"])}


def gpu_two_ranks() -> dict[str, Any]:
    """On 2 GPUs (NCCL): ring attention (cp=2) and Ulysses (sp=2), the plain loop."""
    return {"cp": train("cp", 4, epochs=1), "sp": train("distributed", 4, epochs=1)}


def _peer_fault(fault: str) -> tuple[str, str, float]:
    """Rank 1 dies (``dead``) or stalls past the timeout (``stalled``) before its second
    forward; rank 0 meets it in the attention's all-to-all."""
    import os
    import time

    from .._timeouts import scaled

    start = time.monotonic()
    try:
        with distributed(sp=2, timeout=scaled(60) if fault == "dead" else scaled(6)):
            model = TinyLM()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            for step, b in enumerate(DataLoader(Tokens(), batch_size=2)):
                if step == 2 and state().rank == 1:
                    time.sleep(scaled(1.5))  # its heartbeat has published where it is
                    if fault == "dead":
                        os._exit(3)
                    time.sleep(scaled(12))  # past the 6 s timeout
                F.cross_entropy(model(b["input_ids"]).reshape(-1, VOCAB),
                                b["labels"].reshape(-1)).backward()
                opt.step()
                opt.zero_grad()
        return ("ok", "", time.monotonic() - start)
    except Exception as exc:
        return (type(exc).__name__, str(exc), time.monotonic() - start)


def dead_peer() -> tuple[str, str, float]:
    return _peer_fault("dead")


def stalled_peer() -> tuple[str, str, float]:
    return _peer_fault("stalled")
