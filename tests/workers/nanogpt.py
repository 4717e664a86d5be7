"""A nanoGPT-style model and training loop (after Karpathy's nanoGPT, MIT), small enough for CPU.

`train_scoped` is nanoGPT's loop with its DDP/AMP touch points removed: no init_process_group,
no DDP wrapper, no autocast context, no GradScaler, no manual loss division or
require_backward_grad_sync — the scopes provide those. `train_by_hand` keeps them, as
nanoGPT's train.py has them.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from accel_ctx import accumulate, distributed, mixed_precision, state

from .common import by_hand


@dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = 37
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss

    def configure_optimizers(self, weight_decay: float, learning_rate: float, betas: tuple[float, float]) -> torch.optim.Optimizer:
        params = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        decay = [p for p in params.values() if p.dim() >= 2]
        nodecay = [p for p in params.values() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": nodecay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


DATA = (torch.arange(4000) * 7 + torch.arange(4000) // 50) % 37  # learnable: next token follows
MAX_ITERS, ACCUM, BATCH, LR, WARMUP = 6, 2, 4, 6e-3, 2


def get_batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    block = 16
    ix = torch.randint(len(DATA) - block, (BATCH,), generator=generator)
    x = torch.stack([DATA[i : i + block] for i in ix])
    y = torch.stack([DATA[i + 1 : i + 1 + block] for i in ix])
    return x, y


def get_lr(it: int) -> float:
    if it < WARMUP:
        return LR * (it + 1) / (WARMUP + 1)
    ratio = (it - WARMUP) / (MAX_ITERS - WARMUP)
    return 6e-4 + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LR - 6e-4)


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_scoped() -> dict[str, Any]:
    with distributed(), mixed_precision("bf16"), accumulate(ACCUM):
        torch.manual_seed(1337 + state().rank)
        data_rng = torch.Generator().manual_seed(100 + state().rank)
        model = GPT(GPTConfig())
        optimizer = model.configure_optimizers(0.1, LR, (0.9, 0.95))
        X, Y = get_batch(data_rng)
        losses = []
        for iter_num in range(MAX_ITERS):
            for param_group in optimizer.param_groups:
                param_group["lr"] = get_lr(iter_num)
            for _ in range(ACCUM):
                logits, loss = model(X, Y)
                X, Y = get_batch(data_rng)
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        model.eval()
        with torch.no_grad():
            _, eval_loss = model(*get_batch(data_rng))
        return {"params": params(model), "losses": losses, "eval": eval_loss.item(),
                "logits_dtype": logits.dtype, "step": state().step}


def train_by_hand() -> dict[str, Any]:
    rank = int(os.environ["RANK"])
    torch.manual_seed(1337 + rank)
    data_rng = torch.Generator().manual_seed(100 + rank)
    model = GPT(GPTConfig())
    optimizer = model.configure_optimizers(0.1, LR, (0.9, 0.95))
    model = DDP(model)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    X, Y = get_batch(data_rng)
    for iter_num in range(MAX_ITERS):
        for param_group in optimizer.param_groups:
            param_group["lr"] = get_lr(iter_num)
        for micro_step in range(ACCUM):
            model.require_backward_grad_sync = micro_step == ACCUM - 1
            with ctx:
                _logits, loss = model(X, Y)
                loss = loss / ACCUM
            X, Y = get_batch(data_rng)
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return {"params": params(model.module)}


def run_both() -> dict[str, Any]:
    scoped = train_scoped()
    hand = by_hand(train_by_hand)
    return {"scoped": scoped, "hand": hand}
