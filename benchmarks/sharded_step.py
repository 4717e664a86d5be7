"""Sharded training step: ``sharded()`` around a plain loop vs the loop written by hand with
torch's ``fully_shard`` (FSDP2); and the memory each rank holds, against a data-parallel run.

Two ranks (spawned processes, gloo on CPU, one thread each) train a GPT-shaped model (``GPT`` of
``_models.py``: tied embeddings, 12 blocks of width 512, vocabulary 16384: 46.3M parameters) on
random tokens in memory, sequence 64, batch 2 per rank, AdamW:

==========  ===============================================  ======================================
            hand-written (A)                                 accel_ctx (B)
==========  ===============================================  ======================================
setup       ``init_process_group``, ``init_device_mesh``,    ``with distributed(), sharded():``
            ``fully_shard`` per block then on the root,      the plain model; AdamW made before the
            AdamW made after sharding                        first forward (sharded() re-points it)
data        each rank's batches picked out by hand           a DataLoader over the whole data set
loop        forward, ``F.cross_entropy``, backward, ``clip_grad_norm_(model.parameters(), 1.0)``,
            ``opt.step()``, ``opt.zero_grad(set_to_none=True)`` (the same code on both sides)
==========  ===============================================  ======================================

Both sides start from the same weights (the same seed on every rank) and see the same batches
(rank ``r`` takes batch ``r`` of every ``W`` consecutive ones, as accel_ctx shards a loader).

1. **Step time.** One pair of processes runs the blocks in the alternating order of
   ``_measure.plan`` (A/B pairs beside A/A pairs). Every block starts a fresh process group,
   model, optimizer and loader, trains one step untimed (warm-up: sharding, the first
   all-gathers, AdamW's state), then times ``--steps`` steps. Per step: wall = slowest rank,
   CPU = mean over ranks of the process CPU time.
2. **Memory.** A fresh pair of processes per side: A, B and DDP (``with distributed():`` alone,
   the data-parallel run that sharding should shrink to 1/W). Each trains 2 steps, then a third
   stopped before ``zero_grad``, and every rank counts the bytes it holds locally: parameters,
   gradients and optimizer state (a DTensor's local shard; each tensor once), and its peak RSS
   (``getrusage`` ``ru_maxrss``: the whole process, so it includes the start, Python and torch,
   whose RSS is printed beside it, as is the RSS at the time of the count). These processes run with
   ``MALLOC_MMAP_THRESHOLD_=131072`` unless it is set: glibc's moving threshold otherwise keeps
   freed tensors in its heap and the peak measures the allocator (~1.2 GB instead of ~0.8 GB
   for a fully_shard rank here). DDP's gradient buckets and FSDP's transient all-gather
   buffers are not in the byte counts; the peak RSS has them. The three sides' losses are
   printed too: same weights and batches, so they agree to float rounding (~1e-6 relative).

Targets (issue 13): step time <= 1.02 x hand-written; per-rank state bytes <= DDP's / W + 10 %.

    python benchmarks/sharded_step.py            # full run, ~5 min on 2 cores
    python benchmarks/sharded_step.py --quick    # smoke run (a tiny GPT), well under a minute
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import gc
import itertools
import multiprocessing as mp
import queue
import resource
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _measure import ACCEL, REF, Comparison, Sample, Timer, assert_stock, plan, table
from _models import GPT, GPTConfig, make_gpt, make_tokens, parameter_count
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from accel_ctx import distributed, sharded

BATCH = 2  # per rank
LR = 3e-4
TARGET = 1.02
MEMORY_TARGET = 1.10  # x (DDP's bytes / W)
LOSS_RTOL = 1e-4  # fp32, 3 steps from the same weights: the sides differ by rounding only
DDP = "DDP"
FULL = GPTConfig(vocab=16384, seq=64, width=512, layers=12, heads=8)
QUICK = GPTConfig(vocab=1024, seq=32, width=128, layers=4, heads=4)
SIDE_NAMES = {REF: "A fully_shard", ACCEL: "B sharded()", DDP: "DDP distributed()"}


@dataclass(frozen=True)
class Settings:
    cfg: GPTConfig
    pairs: int
    steps: int  # timed steps per block
    warmup: int  # untimed steps per block


@dataclass
class Outcome:
    """What one side's block yields: its time per step, its losses, and (if asked) its memory."""

    sample: Sample
    losses: list[float]
    memory: dict[str, int] = field(default_factory=dict)


class Rank:
    """This process's place in the job and the hand-written side's store."""

    def __init__(self, rank: int, world: int, store_path: str) -> None:
        self.rank, self.world = rank, world
        self.store = dist.FileStore(store_path, world)
        self.generation = itertools.count()


# ------------------------------------------------------------------------------------------------
# what a rank holds
# ------------------------------------------------------------------------------------------------
def _bytes(tensors: Iterator[torch.Tensor]) -> int:
    """Bytes of the tensors' local data, each counted once (a DTensor: its local shard)."""
    seen: set[tuple[int, int, int, torch.dtype]] = set()
    total = 0
    with torch.no_grad():
        for tensor in tensors:
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            key = (local.untyped_storage().data_ptr(), local.storage_offset(), local.numel(),
                   local.dtype)
            if key not in seen:
                seen.add(key)
                total += local.numel() * local.element_size()
    return total


def held(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Parameter, gradient and optimizer-state bytes held by this rank; how many parameters
    are DTensors; the global parameter count (the same model on every side)."""
    params = list(model.parameters())
    state = (v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    return {
        "params": _bytes(iter(params)),
        "grads": _bytes(p.grad for p in params if p.grad is not None),
        "optimizer": _bytes(state),
        "dtensors": sum(isinstance(p, DTensor) for p in params),
        "tensors": len(params),
        "numel": sum(p.numel() for p in params),
        "optimized": sum(len(g["params"]) for g in opt.param_groups),
    }


def rss_now() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


# ------------------------------------------------------------------------------------------------
# the sides
# ------------------------------------------------------------------------------------------------
def train(
    ctx: Rank, model: torch.nn.Module, opt: torch.optim.Optimizer, loader: DataLoader[Any],
    warmup: int, steps: int, measure: bool,
) -> Outcome:
    """``warmup`` untimed steps, ``steps`` timed ones (all ranks agreed), and with ``measure``
    one more step whose gradients are counted before ``zero_grad``. The loop a user writes."""
    losses: list[torch.Tensor] = []

    def step(x: torch.Tensor, y: torch.Tensor, zero: bool = True) -> None:
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if zero:
            opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    batches = iter(loader)
    for _ in range(warmup):
        step(*next(batches))
    dist.barrier()
    with Timer() as timer:
        for _ in range(steps):
            step(*next(batches))
    wall = torch.tensor([timer.wall], dtype=torch.float64)
    cpu = torch.tensor([timer.cpu], dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu, op=dist.ReduceOp.SUM)
    memory: dict[str, int] = {}
    if measure:
        x, y = next(batches)
        step(x, y, zero=False)
        memory = {**held(model, opt), "rss_held": rss_now()}
        opt.zero_grad(set_to_none=True)
    if next(batches, None) is not None:  # the data is exactly one epoch: end it as a loop would
        raise AssertionError("the loader has more batches than the block trains on")
    # Let gloo's worker threads finish freeing the all-reduces' work (they need the GIL) before
    # the group goes: see step_time.py, where a late reducer deadlocked on it.
    dist.barrier()
    time.sleep(0.05)
    return Outcome(Sample(wall.item() / steps, cpu.item() / ctx.world / steps),
                   [loss.item() for loss in losses], memory)


def hand_shard(data: TensorDataset, rank: int, world: int) -> TensorDataset:
    """This rank's batches: batch ``rank`` of every ``world`` consecutive batches of ``BATCH``."""
    return TensorDataset(
        *(t.unflatten(0, (-1, world, BATCH))[:, rank].flatten(0, 1) for t in data.tensors)
    )


def hand_written(
    ctx: Rank, cfg: GPTConfig, data: TensorDataset, warmup: int, steps: int, measure: bool
) -> Outcome:
    """The loop as one writes it with FSDP2: a mesh, ``fully_shard`` per block and on the root."""
    assert_stock()
    store = dist.PrefixStore(f"hand/{next(ctx.generation)}", ctx.store)
    dist.init_process_group("gloo", store=store, rank=ctx.rank, world_size=ctx.world)
    try:
        mesh = init_device_mesh("cpu", (ctx.world,))
        model = make_gpt(cfg)  # the same seed on every rank: the same weights as a broadcast
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        loader = DataLoader(hand_shard(data, ctx.rank, ctx.world), batch_size=BATCH)
        return train(ctx, model, opt, loader, warmup, steps, measure)
    finally:
        model = opt = mesh = None  # type: ignore[assignment]
        gc.collect()
        dist.destroy_process_group()


def with_accel_ctx(
    ctx: Rank, cfg: GPTConfig, data: TensorDataset, warmup: int, steps: int, measure: bool
) -> Outcome:
    """The plain loop inside ``distributed(), sharded()``; the optimizer made before sharding."""
    with distributed(), sharded():
        model = make_gpt(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        loader = DataLoader(data, batch_size=BATCH)
        return train(ctx, model, opt, loader, warmup, steps, measure)


def data_parallel(
    ctx: Rank, cfg: GPTConfig, data: TensorDataset, warmup: int, steps: int, measure: bool
) -> Outcome:
    """The same loop inside ``distributed()`` alone: every rank holds everything (DDP)."""
    with distributed():
        model = make_gpt(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        loader = DataLoader(data, batch_size=BATCH)
        return train(ctx, model, opt, loader, warmup, steps, measure)


SIDES: dict[str, Callable[..., Outcome]] = {
    REF: hand_written, ACCEL: with_accel_ctx, DDP: data_parallel,
}


# ------------------------------------------------------------------------------------------------
# one rank
# ------------------------------------------------------------------------------------------------
def time_blocks(ctx: Rank, settings: Settings, report: Callable[..., None]) -> None:
    cfg, world = settings.cfg, ctx.world
    data = make_tokens(cfg, world * BATCH * (settings.warmup + settings.steps))
    # A warm-up pair, discarded: the first-call costs of both sides (imports, FSDP's setup).
    probe = make_tokens(cfg, world * BATCH * 2)
    hand_written(ctx, cfg, probe, 1, 1, False)
    with_accel_ctx(ctx, cfg, probe, 1, 1, False)
    # Everything alive now is long-lived: keep full collections of torch's objects out of blocks.
    gc.collect()
    gc.freeze()
    for block in plan(settings.pairs):
        side = SIDES[ACCEL if block.side == ACCEL else REF]
        gc.collect()  # the previous block's garbage, outside every timed region
        outcome = side(ctx, cfg, data, settings.warmup, settings.steps, False)
        report("sample", block, outcome.sample, outcome.losses[-1])


def measure_side(ctx: Rank, settings: Settings, side: str, report: Callable[..., None]) -> None:
    start = rss_now()  # Python, torch and accel_ctx imported; nothing built yet
    cfg = settings.cfg
    data = make_tokens(cfg, ctx.world * BATCH * 3)
    outcome = SIDES[side](ctx, cfg, data, 1, 1, True)
    report("memory", side, {**outcome.memory, "rss_start": start, "rss_peak": peak_rss()},
           outcome.losses)


def worker(
    rank: int, world: int, tmp: str, settings: Settings, job: str, results: Any
) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world), ACCEL_CTX_INIT_METHOD=f"file://{tmp}/accel-store",
    )
    torch.set_num_threads(1)
    assert_stock()  # captures the stock entry points before any scope opens

    def report(kind: str, *message: Any) -> None:
        if kind == "memory" or rank == 0:  # timings are agreed; memory is per rank
            results.put((kind, rank, *message))

    try:
        ctx = Rank(rank, world, f"{tmp}/hand-store")
        if job == "time":
            time_blocks(ctx, settings, report)
        else:
            measure_side(ctx, settings, job, report)
        results.put(("done", rank, None, None, None))
    except BaseException:
        results.put(("error", rank, traceback.format_exc(), None, None))


# ------------------------------------------------------------------------------------------------
# the parent
# ------------------------------------------------------------------------------------------------
def run(settings: Settings, job: str, world: int, timeout: float) -> Iterator[tuple[Any, ...]]:
    """Start the ranks on ``job`` and yield what they report until every rank is done."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="accel-ctx-bench-") as tmp:
        procs = [
            ctx.Process(target=worker, args=(r, world, tmp, settings, job, results))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        done: set[int] = set()
        deadline = time.monotonic() + timeout
        try:
            while len(done) < world:
                if time.monotonic() > deadline:
                    raise SystemExit(f"sharded_step: ranks {set(range(world)) - done} timed out")
                try:
                    message = results.get(timeout=1.0)
                except queue.Empty:
                    dead = [p for p in procs if p.exitcode not in (None, 0)]
                    if dead:
                        raise SystemExit(
                            f"sharded_step: a rank died (exit code {dead[0].exitcode})"
                        ) from None
                    continue
                kind, rank = message[0], message[1]
                if kind == "error":
                    raise SystemExit(f"sharded_step: rank {rank} failed ({job}):\n{message[2]}")
                if kind == "done":
                    done.add(rank)
                    continue
                yield message
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def memory_table(found: dict[str, dict[int, dict[str, int]]], world: int) -> str:
    header = (f"{'rank':<5} {'side':<18} {'params':>8} {'grads':>8} {'optimizer':>9} "
              f"{'total':>8} {'DTensor params':>14} {'peak RSS':>9} {'RSS at start':>12} {'RSS then':>9}")
    lines = ["memory per rank, MiB: bytes held locally after a step, before zero_grad; peak RSS "
             "of the whole process", header, "-" * len(header)]
    for rank in range(world):
        for side in (REF, ACCEL, DDP):
            m = found[side][rank]
            lines.append(
                f"{rank:<5} {SIDE_NAMES[side]:<18} {_mib(m['params']):>8} {_mib(m['grads']):>8}"
                f" {_mib(m['optimizer']):>9} {_mib(m['total']):>8}"
                f" {str(m['dtensors']) + '/' + str(m['tensors']):>14}"
                f" {_mib(m['rss_peak']):>9} {_mib(m['rss_start']):>12} {_mib(m['rss_held']):>9}"
            )
    for side in (ACCEL, DDP):  # the same model, every parameter under the optimizer
        for rank in range(world):
            m, a = found[side][rank], found[REF][rank]
            if m["numel"] != a["numel"] or m["optimized"] != m["tensors"]:
                lines.append(f"  <-- MISMATCH: {SIDE_NAMES[side]} rank {rank} has {m['numel']} "
                             f"parameters (A {a['numel']}), {m['optimized']} of its "
                             f"{m['tensors']} parameter tensors in the optimizer")
    lines.append(f"target: B's total <= DDP's / {world} x {MEMORY_TARGET:.2f}")
    for rank in range(world):
        a, b, ddp = (found[side][rank] for side in (REF, ACCEL, DDP))
        share = b["total"] / (ddp["total"] / world)
        verdict = "ok" if share <= MEMORY_TARGET else "OVER"
        lines.append(
            f"  rank {rank}: B / A = {b['total'] / a['total']:.3f} bytes, "
            f"{b['rss_peak'] / a['rss_peak']:.3f} peak RSS; "
            f"B / (DDP / {world}) = {share:.3f} ({verdict}); A / (DDP / {world}) = "
            f"{a['total'] / (ddp['total'] / world):.3f}"
        )
    return "\n".join(lines)


def loss_lines(losses: dict[str, list[float]]) -> str:
    """Rank 0's losses per side and how far B and DDP are from A (same weights and batches)."""
    lines = ["losses (rank 0; the same weights and batches on every side):"]
    for side in (REF, ACCEL, DDP):
        values = losses[side]
        spread = max(abs(v - a) / abs(a) for v, a in zip(values, losses[REF], strict=True))
        flag = "   <-- MISMATCH" if spread > LOSS_RTOL else ""
        lines.append(f"  {SIDE_NAMES[side]:<18} " + " ".join(f"{v:.6f}" for v in values)
                     + (f"   max rel. diff from A {spread:.1e}{flag}" if side != REF else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: a tiny GPT, 2 pairs (figures are noise)")
    parser.add_argument("--pairs", type=int, help="alternating pairs (default 5; quick 2)")
    parser.add_argument("--steps", type=int, help="timed steps per block (default 3; quick 2)")
    parser.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--skip-time", action="store_true", help="only the memory part")
    args = parser.parse_args(argv)
    quick = args.quick
    settings = Settings(
        cfg=QUICK if quick else FULL,
        pairs=args.pairs or (2 if quick else 5),
        steps=args.steps or (2 if quick else 3),
        warmup=1,
    )
    torch.set_num_threads(1)
    cfg, world = settings.cfg, args.world
    params = parameter_count(GPT(cfg))
    print(f"sharded_step: {world} ranks (gloo, CPU, 1 thread each); GPT vocab {cfg.vocab}, "
          f"seq {cfg.seq}, width {cfg.width}, {cfg.layers} layers, {cfg.heads} heads, tied "
          f"embeddings: {params / 1e6:.1f}M parameters; batch {BATCH} per rank, AdamW, "
          f"clip 1.0; {settings.pairs} pairs, {settings.warmup} warm-up + {settings.steps} timed "
          f"steps per block; torch {torch.__version__}, {os.cpu_count()} CPUs", flush=True)
    start = time.perf_counter()
    if not args.skip_time:
        comparison = Comparison("GPT fp32 AdamW")
        for _, _, block, sample, loss in run(settings, "time", world, timeout=1800.0):
            comparison.add(block, sample)
            print(f"  pair {block.pair} {block.kind} {block.side:<2} {sample.wall * 1e3:8.1f} "
                  f"ms/step wall {sample.cpu * 1e3:8.1f} ms/step cpu  last loss {loss:.6f}",
                  file=sys.stderr, flush=True)
        print(table([comparison], "optimizer step", TARGET), flush=True)
    # glibc raises its mmap threshold as large blocks are freed, then keeps freed tensors in
    # its heap: the peak RSS of a 46M-parameter FSDP rank then reads ~1.2 GB where ~0.8 GB is
    # ever in use (seen here). A fixed threshold (glibc's initial one) makes the peak measure
    # the program; set MALLOC_MMAP_THRESHOLD_ yourself to measure something else.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    found: dict[str, dict[int, dict[str, int]]] = {}
    losses: dict[str, list[float]] = {}
    for side in (REF, ACCEL, DDP):
        for _, rank, _, memory, side_losses in run(settings, side, world, timeout=900.0):
            memory["total"] = memory["params"] + memory["grads"] + memory["optimizer"]
            found.setdefault(side, {})[rank] = memory
            if rank == 0:
                losses[side] = side_losses
        print(f"  memory of {SIDE_NAMES[side]} measured", file=sys.stderr, flush=True)
    print(memory_table(found, world))
    print(f"(memory processes ran with MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']})")
    print(loss_lines(losses))
    print(f"({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
