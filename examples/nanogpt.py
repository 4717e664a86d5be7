"""A nanoGPT-shaped run: a small GPT in bf16 with gradient accumulation, checkpoints and resume.

nanoGPT's train.py has a handful of DDP/AMP touch points (DDP wrapper, autocast context,
GradScaler, no_sync, the loss division, rank checks): here they are the scopes, and the loop is
left as it is. Stop it at any time and run it again: it resumes from the last checkpoint, with
the same batches it would have seen.

    python examples/nanogpt.py --out runs/gpt
    accel-ctx launch -n 2 examples/nanogpt.py --out runs/gpt
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel_ctx import (
    accumulate,
    distributed,
    load_state,
    main_print,
    mixed_precision,
    save_model,
    save_state,
    state,
)

VOCAB, SEQ, WIDTH, LAYERS, HEADS = 256, 32, 64, 2, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
        self.register_buffer("mask", torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask[: x.shape[1], : x.shape[1]],
                          need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2
        for module in self.modules():  # GPT-2's initialisation
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(
            logits.view(-1, VOCAB), targets.view(-1))
        return logits, loss


def tokens(n: int = 512) -> TensorDataset:
    """A text the model can learn: a repeating pattern with noise."""
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    seq = (start + torch.arange(SEQ + 1)) % VOCAB
    return TensorDataset(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/nanogpt")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None, help="stop after this many steps")
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--precision", default="bf16", choices=["no", "bf16", "fp16"])
    args = parser.parse_args()

    torch.manual_seed(1337)
    with distributed(), mixed_precision(args.precision), accumulate(args.accumulate):
        model = GPT()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
        loader = DataLoader(tokens(), batch_size=16, shuffle=True)
        total = args.epochs * math.ceil(len(loader) / args.accumulate)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=total)
        resumed = load_state(args.out, model=model, optimizer=optimizer, scheduler=scheduler)
        if resumed:
            main_print(f"resumed from {args.out} at step {resumed.step}, epoch {resumed.epoch}")
        done, loss = False, None
        for _epoch in range(resumed.epoch, args.epochs):
            for x, y in loader:
                _, loss = model(x, y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                if state().sync_gradients and state().step % 5 == 0:
                    main_print(f"step {state().step}: loss {loss.item():.3f}")
                    save_state(args.out, model=model, optimizer=optimizer, scheduler=scheduler)
                if args.steps is not None and state().step >= args.steps:
                    done = True
                    break
            if done:
                break
        if loss is None:
            main_print(f"{args.out} holds a finished run (step {state().step}): nothing to do")
            return
        save_state(args.out, model=model, optimizer=optimizer, scheduler=scheduler)
        save_model(model, f"{args.out}/model.safetensors")  # plain weights, loadable by torch alone
        main_print(f"done: step {state().step}, loss {loss.item():.3f}, saved in {args.out}")


if __name__ == "__main__":
    main()
