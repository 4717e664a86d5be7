"""The models and in-memory data the benchmarks train and evaluate."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

CLASSES = 10


class MLP(nn.Sequential):
    """A small MLP: 64 -> 256 -> 256 -> 10 (6 modules)."""

    features = 64

    def __init__(self) -> None:
        super().__init__(
            nn.Linear(self.features, 256), nn.ReLU(),
            nn.Linear(256, 256), nn.ReLU(),
            nn.Linear(256, CLASSES),
        )


class Block(nn.Module):
    """One tiny block: Linear + Tanh (3 modules with itself)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class DeepStack(nn.Module):
    """A deep stack of tiny blocks: ``3 * depth + 3`` modules, almost all call overhead."""

    def __init__(self, depth: int, width: int = 32) -> None:
        super().__init__()
        self.features = width
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def depth_for(modules: int) -> int:
    """The DeepStack depth giving about ``modules`` modules in all."""
    return max(1, round((modules - 3) / 3))


def make_model(name: str) -> nn.Module:
    """``"mlp"``, ``"gpt"`` (a small :class:`GPT`, :data:`SMALL_GPT`) or ``"deepN"`` (a
    DeepStack of about N modules), seeded the same every time."""
    torch.manual_seed(0)
    if name == "mlp":
        return MLP()
    if name == "gpt":
        return make_gpt(SMALL_GPT)
    if name.startswith("deep"):
        return DeepStack(depth_for(int(name[4:])))
    raise ValueError(f"unknown model {name!r}: use 'mlp', 'gpt' or 'deepN' (N modules)")


def make_data_for(name: str, samples: int, seed: int = 1234) -> TensorDataset:
    """``samples`` inputs and targets for :func:`make_model` ``(name)``, in memory."""
    if name == "gpt":
        return make_tokens(SMALL_GPT, samples, seed)
    return make_data(features_of(make_model(name)), samples, seed)


def loss_for(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The training loss of :func:`make_model` ``(name)``: cross-entropy over classes, or over
    the vocabulary at every position."""
    return next_token_loss if name == "gpt" else F.cross_entropy


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``(batch, seq, vocab)`` logits against ``(batch, seq)`` next tokens."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def features_of(model: nn.Module) -> int:
    return int(model.features)  # type: ignore[arg-type]


def make_data(features: int, samples: int, seed: int = 1234) -> TensorDataset:
    """``samples`` random inputs with class labels, in memory."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(samples, features, generator=g),
        torch.randint(0, CLASSES, (samples,), generator=g),
    )


# ------------------------------------------------------------------------------------------------
# a GPT-shaped language model (the sharded benchmark's)
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GPTConfig:
    """The shape of a :class:`GPT`: nanoGPT's layout, without dropout or biases in the heads."""

    vocab: int = 16384
    seq: int = 64
    width: int = 512
    layers: int = 12
    heads: int = 8


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class GPTBlock(nn.Module):
    """Pre-norm transformer block: LayerNorm, causal self-attention, LayerNorm, 4x MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.width)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.width, 4 * cfg.width), nn.GELU(), nn.Linear(4 * cfg.width, cfg.width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + position embeddings, ``layers`` blocks in a ModuleList, a final LayerNorm and an
    ``lm_head`` tied to the token embedding: ``(batch, seq)`` tokens -> ``(batch, seq, vocab)``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.width)
        self.wpe = nn.Embedding(cfg.seq, cfg.width)
        self.blocks = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.width)
        self.lm_head = nn.Linear(cfg.width, cfg.vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2
        for module in self.modules():  # GPT-2's initialisation: logits start near uniform
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


SMALL_GPT = GPTConfig(vocab=256, seq=32, width=64, layers=2, heads=4)
"""The ``"gpt"`` model of the step-time benchmark: 0.9 M parameters, 4 blocks."""


def make_gpt(cfg: GPTConfig) -> GPT:
    """A :class:`GPT`, seeded the same every time (so every rank builds the same weights)."""
    torch.manual_seed(0)
    return GPT(cfg)


def parameter_count(model: nn.Module) -> int:
    """Parameters counted once each (a tied weight once)."""
    return sum(p.numel() for p in model.parameters())


def make_tokens(cfg: GPTConfig, samples: int, seed: int = 1234) -> TensorDataset:
    """``samples`` random token sequences as (inputs, next-token targets), in memory."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab, (samples, cfg.seq + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
