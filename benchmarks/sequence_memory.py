"""What ``sp=2`` saves in activation memory per rank, and what its step costs, against one
process on the whole sequence.

Not a GPU figure: on the CPU torch keeps no allocator statistics, so the activation memory is
counted as the bytes the forward saves for the backward (``torch.autograd.graph.
saved_tensors_hooks``: every saved tensor's storage once, parameters left out), which is what
grows with the sequence. A GPT-shaped model (width 128, 8 heads, 4 blocks, vocabulary 512,
learned positions from ``position_ids``) trains on random tokens, batch 1, AdamW, fp32:

- N = 1: one process, the plain loop, no scope (the reference);
- N = 2: two processes (gloo, one thread each), the same loop inside ``distributed(sp=2)``.

Per sequence length: the saved bytes of one forward per rank, the ratio N=2 / N=1 (the target
is about 1/2), and the time per step (after one untimed step; N=2: the slower rank) with its
ratio. The A/A floor is the one-process side run twice. On 2 cores the two ranks share the
machine's cores with nothing else; the all-to-alls are gloo's, over loopback.

    python benchmarks/sequence_memory.py            # ~2 min on 2 cores
    python benchmarks/sequence_memory.py --quick    # short sequences, 1 step: ~20 s
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

WIDTH, HEADS, LAYERS, VOCAB = 128, 8, 4, 512


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH, bias=False), nn.Linear(WIDTH, WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (p.view(b, t, HEADS, -1).transpose(1, 2) for p in self.qkv(self.ln1(x)).split(c, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, length: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(length, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(ids.shape[1]).unsqueeze(0)
        x = self.wte(ids) + self.wpe(position_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)  # type: ignore[no-any-return]


def run(length: int, steps: int) -> tuple[int, float]:
    """The user's loop: (bytes one forward saves for the backward, seconds per timed step)."""
    torch.manual_seed(0)
    model = GPT(length)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, VOCAB, (steps + 1, length + 1), generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=1)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    started = 0.0
    for i, (x, y) in enumerate(loader):
        if i == 1:
            started = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        if i == 0:
            first = sum(saved.values())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return first, (time.perf_counter() - started) / steps


def _rank(rank: int, world: int, tmp: str, lengths: list[int], steps: int, out: dict) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), ACCEL_CTX_INIT_METHOD=f"file://{tmp}/store")
    torch.set_num_threads(1)
    from accel_ctx import distributed

    rows = []
    for length in lengths:
        with distributed(sp=world):
            rows.append(run(length, steps))
    out[rank] = rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lengths, steps = ([128, 256], 1) if args.quick else ([512, 1024, 2048, 4096], 3)
    one = [run(n, steps) for n in lengths]
    again = [run(n, steps) for n in lengths]  # the A/A floor
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, (2, tmp, lengths, steps, out), nprocs=2)
        two = [max((out[r][i] for r in range(2)), key=lambda row: row[1]) for i in range(len(lengths))]
        bytes_two = [max(out[r][i][0] for r in range(2)) for i in range(len(lengths))]
    print(f"GPT width {WIDTH}, {HEADS} heads, {LAYERS} blocks, batch 1; activation bytes saved "
          "by one forward, per rank (MiB); seconds per step")
    print(f"{'length':>7} {'N=1 MiB':>9} {'N=2 MiB':>9} {'ratio':>6} {'N=1 s':>8} {'N=2 s':>8} "
          f"{'ratio':>6} {'A/A':>6}")
    for n, (b1, t1), (_, t1b), (_, t2), b2 in zip(lengths, one, again, two, bytes_two, strict=True):
        print(f"{n:>7} {b1 / 2**20:>9.1f} {b2 / 2**20:>9.1f} {b2 / b1:>6.3f} {t1:>8.3f} {t2:>8.3f} "
              f"{t2 / t1:>6.3f} {t1b / t1:>6.3f}")


if __name__ == "__main__":
    main()
