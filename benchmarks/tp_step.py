"""Tensor-parallel training step: ``sharded(tp=2)`` around a plain loop vs the same plan applied
by hand, torchtitan style; and the parameter bytes each rank holds, against the whole model.

Four ranks (spawned processes, gloo on CPU, one thread each) form a 2 x 2 ("dp", "tp") mesh and
train a GPT-shaped model written for tensor parallelism (``TPGPT`` below: separate q, k, v
projections reshaped by the local head count, an untied ``lm_head``; vocabulary 8192, 4 blocks
of width 256: 7.4M parameters) on random tokens in memory, sequence 64, batch 2 per
data-parallel group, AdamW, fp32, no autocast:

==========  ===============================================  ======================================
            hand-written (A)                                 accel_ctx (B)
==========  ===============================================  ======================================
setup       ``init_process_group``, ``init_device_mesh``     ``with sharded(tp=2, tp_plan=PLAN):``
            ``(2, 2)`` ("dp", "tp"), ``parallelize_module``  the plain model; AdamW made before
            over "tp" with the plan, ``fully_shard`` over    the first forward (the scope points
            "dp" per block then on the root; AdamW after     it at the split, sharded parameters)
data        each data-parallel group's batches by hand       a DataLoader over the whole data set
loop        forward, ``F.cross_entropy``, backward, ``opt.step()``, ``opt.zero_grad(set_to_none=True)``
==========  ===============================================  ======================================

The plan (both sides): q, k, v and the MLP's up projection ``colwise``; the attention output and
the MLP's down projection ``rowwise``; the token embedding ``rowwise`` (by vocabulary); the
``lm_head`` ``colwise_rep`` (split by vocabulary, its logits gathered). Both sides start from
the same weights and see the same batches, so their losses agree to rounding (printed).
No ``clip_grad_norm_``: torch's refuses the mix of 2-D (split) and 1-D (norms) parameters, and
the hand-written loop would need torchtitan's own clipping.

1. **Step time.** One set of 4 processes runs the blocks in the alternating order of
   ``_measure.plan`` (A/B pairs beside A/A pairs). Every block starts a fresh process group,
   mesh, model, optimizer and loader, trains 1 step untimed (splitting, sharding, AdamW's
   state), then times ``--steps`` steps. Per step: wall = slowest rank, CPU = mean over ranks.
2. **Parameter bytes.** After B's warm-up block every rank counts the bytes of the parameters it
   holds (a DTensor's local shard) against the whole model's: target <= 1/(dp x tp) + 10 %.
   What stays whole over "tp" (LayerNorms, the rowwise layers' biases) is in the 10 %.

    python benchmarks/tp_step.py            # ~1 min on 2 cores
    python benchmarks/tp_step.py --quick    # smoke run (a tiny model, 1 pair), ~15 s
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import gc
import itertools
import multiprocessing as mp
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _measure import ACCEL, REF, Comparison, Sample, Timer, assert_stock, plan, table
from _models import GPTConfig, make_tokens, parameter_count
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

from accel_ctx import sharded

BATCH = 2  # per data-parallel group
LR = 3e-4
TARGET = 1.02
BYTES_SLACK = 1.10  # x 1/(dp * tp) of the whole model's parameter bytes
LOSS_RTOL = 1e-4
FULL = GPTConfig(vocab=8192, seq=64, width=256, layers=4, heads=8)
QUICK = GPTConfig(vocab=512, seq=32, width=64, layers=2, heads=4)
PLAN = {
    "wte": "rowwise", "lm_head": "colwise_rep",
    "blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
    "blocks.*.attn.o": "rowwise", "blocks.*.up": "colwise", "blocks.*.down": "rowwise",
}


# ------------------------------------------------------------------------------------------------
# the model: written for tensor parallelism
# ------------------------------------------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.width // cfg.heads
        self.q, self.k, self.v, self.o = (nn.Linear(cfg.width, cfg.width) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape  # by the local head count: a rank holds heads / tp of them
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.width), nn.LayerNorm(cfg.width)
        self.attn = Attention(cfg)
        self.up, self.down = nn.Linear(cfg.width, 4 * cfg.width), nn.Linear(4 * cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TPGPT(nn.Module):
    """Token and position embeddings, blocks, a final LayerNorm and an untied ``lm_head``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(cfg.vocab, cfg.width), nn.Embedding(cfg.seq, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.width)
        self.lm_head = nn.Linear(cfg.width, cfg.vocab, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def make_model(cfg: GPTConfig) -> TPGPT:
    torch.manual_seed(0)  # the same weights on every rank and side
    return TPGPT(cfg)


def torch_plan(model: nn.Module) -> dict[str, Any]:
    """PLAN as torch styles, module by module (what accel_ctx makes of the named styles)."""
    styles: dict[str, Callable[[], Any]] = {
        "colwise": ColwiseParallel, "rowwise": RowwiseParallel,
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate())}
    names = [name for name, _ in model.named_modules()]
    chosen: dict[str, Any] = {}
    for pattern, style in PLAN.items():
        parts = pattern.split(".")
        for name in names:
            segments = name.split(".")
            if len(segments) == len(parts) and all(
                    p in ("*", s) for p, s in zip(parts, segments, strict=True)):
                embedding = isinstance(model.get_submodule(name), nn.Embedding)
                chosen[name] = (RowwiseParallel(input_layouts=Replicate()) if embedding
                                else styles[style]())  # token ids: whole on every rank
    return chosen


# ------------------------------------------------------------------------------------------------
# the sides
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Settings:
    cfg: GPTConfig
    pairs: int
    steps: int
    tp: int


class Rank:
    def __init__(self, rank: int, world: int, tp: int, store_path: str) -> None:
        self.rank, self.world, self.tp = rank, world, tp
        self.dp, self.dp_rank = world // tp, rank // tp  # tp innermost, as accel_ctx's mesh
        self.store = dist.FileStore(store_path, world)
        self.generation = itertools.count()


def local_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank holds (a DTensor's local shard)."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
               for p in model.parameters())


def train(ctx: Rank, model: nn.Module, opt: torch.optim.Optimizer, loader: DataLoader[Any],
          steps: int) -> tuple[Sample, list[float]]:
    """One untimed step, ``steps`` timed ones: the loop a user writes."""
    losses: list[torch.Tensor] = []

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    batches = iter(loader)
    step(*next(batches))
    dist.barrier()
    with Timer() as timer:
        for _ in range(steps):
            step(*next(batches))
    wall = torch.tensor([timer.wall], dtype=torch.float64)
    cpu = torch.tensor([timer.cpu], dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu, op=dist.ReduceOp.SUM)
    if next(batches, None) is not None:
        raise AssertionError("the loader has more batches than the block trains on")
    dist.barrier()
    time.sleep(0.05)  # gloo's threads finish freeing their work before the group goes
    return Sample(wall.item() / steps, cpu.item() / ctx.world / steps), [
        loss.item() for loss in losses]


def hand_written(ctx: Rank, cfg: GPTConfig, data: TensorDataset, steps: int
                 ) -> tuple[Sample, list[float], int]:
    """torchtitan's recipe: a ("dp", "tp") mesh, parallelize_module over "tp", fully_shard over
    "dp" per block and on the root; each data-parallel group's batches picked out by hand."""
    assert_stock()
    store = dist.PrefixStore(f"hand/{next(ctx.generation)}", ctx.store)
    dist.init_process_group("gloo", store=store, rank=ctx.rank, world_size=ctx.world)
    try:
        mesh = init_device_mesh("cpu", (ctx.dp, ctx.tp), mesh_dim_names=("dp", "tp"))
        model = make_model(cfg)
        parallelize_module(model, mesh["tp"], torch_plan(model))
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        mine = TensorDataset(*(t.unflatten(0, (-1, ctx.dp, BATCH))[:, ctx.dp_rank].flatten(0, 1)
                               for t in data.tensors))
        sample, losses = train(ctx, model, opt, DataLoader(mine, batch_size=BATCH), steps)
        return sample, losses, local_bytes(model)
    finally:
        model = opt = mesh = None  # type: ignore[assignment]
        gc.collect()
        dist.destroy_process_group()


def with_accel_ctx(ctx: Rank, cfg: GPTConfig, data: TensorDataset, steps: int
                   ) -> tuple[Sample, list[float], int]:
    """The plain loop inside ``sharded(tp=2, tp_plan=PLAN)``; AdamW made before the split."""
    with sharded(tp=ctx.tp, tp_plan=PLAN):
        model = make_model(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        sample, losses = train(ctx, model, opt, DataLoader(data, batch_size=BATCH), steps)
        return sample, losses, local_bytes(model)


# ------------------------------------------------------------------------------------------------
# one rank, and the parent
# ------------------------------------------------------------------------------------------------
def worker(rank: int, world: int, tmp: str, settings: Settings, results: Any) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world), ACCEL_CTX_INIT_METHOD=f"file://{tmp}/accel-store",
    )
    torch.set_num_threads(1)
    assert_stock()
    try:
        ctx = Rank(rank, world, settings.tp, f"{tmp}/hand-store")
        cfg, steps = settings.cfg, settings.steps
        data = make_tokens(cfg, ctx.dp * BATCH * (1 + steps))
        # a warm-up pair, discarded (first-call costs); B's parameter bytes counted there
        hand_written(ctx, cfg, data, steps)
        _, _, held = with_accel_ctx(ctx, cfg, data, steps)
        results.put(("bytes", rank, held))
        gc.collect()
        gc.freeze()
        for block in plan(settings.pairs):
            side = with_accel_ctx if block.side == ACCEL else hand_written
            gc.collect()
            sample, losses, _ = side(ctx, cfg, data, steps)
            if rank == 0:
                results.put(("sample", rank, block, sample, losses))
        results.put(("done", rank))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))


def run(settings: Settings, world: int, timeout: float) -> Iterator[tuple[Any, ...]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="accel-ctx-bench-") as tmp:
        procs = [ctx.Process(target=worker, args=(r, world, tmp, settings, results))
                 for r in range(world)]
        for p in procs:
            p.start()
        done: set[int] = set()
        deadline = time.monotonic() + timeout
        try:
            while len(done) < world:
                if time.monotonic() > deadline:
                    raise SystemExit(f"tp_step: ranks {set(range(world)) - done} timed out")
                try:
                    message = results.get(timeout=1.0)
                except queue.Empty:
                    dead = [p for p in procs if p.exitcode not in (None, 0)]
                    if dead:
                        raise SystemExit(f"tp_step: a rank died (exit {dead[0].exitcode})") from None
                    continue
                if message[0] == "error":
                    raise SystemExit(f"tp_step: rank {message[1]} failed:\n{message[2]}")
                if message[0] == "done":
                    done.add(message[1])
                    continue
                yield message
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: a tiny model, 1 pair")
    parser.add_argument("--pairs", type=int, help="alternating pairs (default 4; quick 1)")
    parser.add_argument("--steps", type=int, help="timed steps per block (default 4; quick 2)")
    parser.add_argument("--world", type=int, default=4, help="ranks (default 4)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    args = parser.parse_args(argv)
    settings = Settings(cfg=QUICK if args.quick else FULL,
                        pairs=args.pairs or (1 if args.quick else 4),
                        steps=args.steps or (2 if args.quick else 4), tp=args.tp)
    torch.set_num_threads(1)
    cfg, world, tp = settings.cfg, args.world, settings.tp
    dp = world // tp
    full = parameter_count(TPGPT(cfg)) * 4  # fp32
    print(f"tp_step: {world} ranks = {dp} dp x {tp} tp (gloo, CPU, 1 thread each); TPGPT vocab "
          f"{cfg.vocab}, seq {cfg.seq}, width {cfg.width}, {cfg.layers} layers, {cfg.heads} "
          f"heads: {full / 4e6:.1f}M parameters; batch {BATCH} per dp group, AdamW, fp32; "
          f"{settings.pairs} pairs, 1 warm-up + {settings.steps} timed steps per block; "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs", flush=True)
    start = time.perf_counter()
    comparison = Comparison(f"TPGPT {dp}x{tp} fp32 AdamW")
    held: dict[int, int] = {}
    losses: dict[str, list[float]] = {}
    for message in run(settings, world, timeout=1800.0):
        if message[0] == "bytes":
            held[message[1]] = message[2]
            continue
        _, _, block, sample, block_losses = message
        comparison.add(block, sample)
        losses.setdefault(block.side, block_losses)
        print(f"  pair {block.pair} {block.kind} {block.side:<2} {sample.wall * 1e3:8.1f} ms/step "
              f"wall {sample.cpu * 1e3:8.1f} ms/step cpu  last loss {block_losses[-1]:.6f}",
              file=sys.stderr, flush=True)
    print(table([comparison], "optimizer step", TARGET))
    share = 1 / (dp * tp)
    print(f"parameter bytes per rank under sharded(tp={tp}) (whole model {full / 2**20:.2f} MiB; "
          f"target <= 1/({dp}x{tp}) x {BYTES_SLACK:.2f} = {share * BYTES_SLACK:.3f} of it):")
    for rank in sorted(held):
        ratio = held[rank] / full
        print(f"  rank {rank}: {held[rank] / 2**20:.3f} MiB = {ratio:.3f} of the model "
              f"({ratio / share:.3f} x 1/{dp * tp}) {'ok' if ratio <= share * BYTES_SLACK else 'OVER'}")
    a, b = losses.get(REF, []), losses.get(ACCEL, [])
    spread = max((abs(x - y) / abs(y) for x, y in zip(b, a, strict=True)), default=0.0)
    print(f"losses (rank 0, one block each): A {' '.join(f'{v:.6f}' for v in a)}; "
          f"B {' '.join(f'{v:.6f}' for v in b)}; max rel. diff {spread:.1e}"
          + ("   <-- MISMATCH" if spread > LOSS_RTOL else ""))
    print(f"({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
