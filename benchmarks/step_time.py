"""Training step time: accel_ctx scopes around a plain loop vs the same loop written by hand.

Two ranks (spawned processes, gloo on CPU) run both sides in turn, in the alternating order of
``_measure.plan``; every block starts a fresh process group, model, optimizer and loader, trains
one epoch untimed (warm-up), then times whole epochs. Per row:

=========  ==========================================  =========================================
row        hand-written (A)                            accel_ctx (B)
=========  ==========================================  =========================================
fp32       DDP + DistributedSampler                    ``with distributed():`` plain loop
bf16       ... + ``torch.autocast`` (bf16) over forward ... + ``mixed_precision("bf16")``
           and loss (torch's AMP recipe)
fp16       ... + autocast (fp16) + ``GradScaler``      ... + ``mixed_precision("fp16")``
accum4     ... + ``ddp.no_sync()`` on 3 of 4 micro-    ... + ``accumulate(4)``
           batches, loss / 4, step every 4th
=========  ==========================================  =========================================

Models (``--models``): ``mlp`` (a small MLP: a step of about 2 ms, where a fixed cost per step
shows most), ``gpt`` (a small GPT-shaped language model, 0.1 M parameters: about 20 ms) and
``deepN`` (a stack of about N tiny modules: per-submodule costs).

Both sides train on the same in-memory data with the same per-rank batch size and number of
steps, with subnormal floats flushed to zero in every rank (the two sides' batch orders differ,
so their weights do, and arithmetic on subnormals is many times slower on x86: without the flush
a deep200 row swung by -9 % to +21 % on that alone). The hand-written side is torch's AMP
recipe (forward and loss under autocast, backward and step outside), which is the rule
``mixed_precision`` follows, so both do the same work.
accel_ctx broadcasts rank 0's sampling RNG at the start of every epoch (DistributedSampler
needs no collective): that cost is in its figures, spread over the epoch's batches.
Times are per optimizer step: wall = slowest rank, CPU = mean over ranks of the process CPU time.

    python benchmarks/step_time.py            # full run, a few minutes on 2 cores
    python benchmarks/step_time.py --quick    # smoke run, well under a minute
    python benchmarks/step_time.py --check    # count collectives and real steps of each side
    python benchmarks/step_time.py --compile  # both sides call torch.compile(model) (inductor)
    python benchmarks/step_time.py --interleaved  # one group, the loops side by side (see
                                                  # run_rows_interleaved): pairs closer in time
    python benchmarks/step_time.py --step-pairs   # ... taking turns at every step (see
                                                  # run_rows_step_pairs): the finest figures

With ``--compile`` the hand-written side is ``DDP(torch.compile(model))`` and the accel_ctx side
calls ``torch.compile(model)`` inside the scopes (which wrap DDP around it: the same structure).
Every block resets Dynamo, so each block compiles afresh in its untimed warm-up epoch.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import contextvars
import cProfile
import gc
import itertools
import multiprocessing as mp
import pstats
import queue
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from _measure import (
    ACCEL,
    REF,
    REF2,
    Block,
    Comparison,
    Sample,
    Timer,
    assert_stock,
    calibrate,
    plan,
    table,
)
from _models import loss_for, make_data_for, make_model
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from accel_ctx import accumulate, distributed, mixed_precision

BATCH = 32  # per rank
ACCUMULATE = 4
TARGET = 1.02
MODES = ("fp32", "bf16", "fp16", "accum4")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SIDE_FILES = {REF: "hand", ACCEL: "accel"}


@dataclass(frozen=True)
class Row:
    model: str
    mode: str
    batches_per_epoch: int  # per rank; a multiple of ACCUMULATE
    compiled: bool = False

    @property
    def name(self) -> str:
        mode = f"accumulate({ACCUMULATE})" if self.mode == "accum4" else self.mode
        return f"{self.model} {mode}{' compiled' if self.compiled else ''}"

    @property
    def opt_steps_per_epoch(self) -> int:
        return self.batches_per_epoch // (ACCUMULATE if self.mode == "accum4" else 1)


@dataclass(frozen=True)
class Settings:
    pairs: int
    block_seconds: float  # target length of one timed block
    calibrate: bool  # False: one epoch per timed block, one warm-up pair in all
    warmup_epochs: int
    max_epochs: int
    rows: tuple[Row, ...]
    profile: str | None  # cProfile rank 0's accel_ctx blocks into this file
    check: bool  # count the work of one block per side instead of timing
    interleaved: bool = False  # one group, the loops alive side by side (run_rows_interleaved)
    step_pairs: bool = False  # ... taking turns at every optimizer step (run_rows_step_pairs)


# What watches the timed part of a block: (row, side, model, optimizer steps) -> context
Observer = Callable[["Row", str, nn.Module, int], AbstractContextManager[Any]]


class Rank:
    """This process's place in the job, the hand-written side's store, what watches blocks."""

    def __init__(self, rank: int, world: int, store_path: str) -> None:
        self.rank, self.world = rank, world
        self.store = dist.FileStore(store_path, world)
        self.generation = itertools.count()
        self.observe: Observer = lambda row, side, model, steps: nullcontext()


# ------------------------------------------------------------------------------------------------
# the two sides
# ------------------------------------------------------------------------------------------------
def timed_epochs(
    ctx: Rank, row: Row, side: str, model: nn.Module, run_epoch: Callable[[int], None],
    warmup: int, epochs: int,
) -> Sample:
    """Untimed warm-up epochs, then ``epochs`` timed ones; per optimizer step, all ranks agreed."""
    for epoch in range(warmup):
        run_epoch(epoch)
    steps = epochs * row.opt_steps_per_epoch
    dist.barrier()
    with ctx.observe(row, side, model, steps), Timer() as timer:
        for epoch in range(warmup, warmup + epochs):
            run_epoch(epoch)
    wall = torch.tensor([timer.wall], dtype=torch.float64)
    cpu = torch.tensor([timer.cpu], dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu, op=dist.ReduceOp.SUM)
    # Let gloo's worker threads finish: they free the work of the all-reduces above, which
    # needs the GIL. A DDP reducer collected later drops the last reference to its process
    # group and joins those threads *holding* the GIL: a deadlock if one still waits for it
    # (seen here with torch 2.13). The barrier and the sleep release the GIL meanwhile.
    dist.barrier()
    time.sleep(0.05)
    return Sample(wall.item() / steps, cpu.item() / ctx.world / steps)


def compiled(row: Row, model: nn.Module, fresh: bool = True) -> nn.Module:
    """``torch.compile(model)`` (inductor) for a compiled row, by default from a fresh Dynamo:
    a block's model is new, and the per-code recompile limit would otherwise run later blocks
    eagerly (``fresh=False``: models that live side by side, compiled once each)."""
    if not row.compiled:
        return model
    if fresh:
        torch._dynamo.reset()
    return torch.compile(model)  # type: ignore[return-value]


def hand_loop(row: Row, data: TensorDataset, fresh: bool = True
              ) -> tuple[nn.Module, Callable[[int], None]]:
    """The loop as one writes it with DDP, DistributedSampler, autocast, GradScaler, no_sync
    (in the process group already formed): the model and one epoch of the loop."""
    model, epoch_steps = hand_steps(row, data, fresh)
    return model, whole_epochs(epoch_steps)


def hand_steps(row: Row, data: TensorDataset, fresh: bool = True
               ) -> tuple[nn.Module, Callable[[int], Iterator[None]]]:
    """``hand_loop``'s model and epoch, the epoch pausing after each optimizer step."""
    model = make_model(row.model)
    ddp = DDP(compiled(row, model, fresh))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    dtype = DTYPES.get(row.mode)
    scaler = torch.amp.GradScaler("cpu") if row.mode == "fp16" else None
    loss_of = loss_for(row.model)

    def epoch_steps(epoch: int) -> Iterator[None]:
        sampler.set_epoch(epoch)
        if row.mode == "accum4":
            for i, (x, y) in enumerate(loader):
                boundary = (i + 1) % ACCUMULATE == 0
                with nullcontext() if boundary else ddp.no_sync():
                    loss = loss_of(ddp(x), y) / ACCUMULATE
                    loss.backward()
                if boundary:
                    opt.step()
                    opt.zero_grad()
                    yield
        elif dtype is None:
            for x, y in loader:
                loss = loss_of(ddp(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                yield
        else:
            for x, y in loader:
                with torch.autocast("cpu", dtype=dtype):  # torch's AMP recipe
                    loss = loss_of(ddp(x), y)
                if scaler is not None:
                    scaler.scale(loss).backward()
                    scaler.step(opt)
                    scaler.update()
                else:
                    loss.backward()
                    opt.step()
                opt.zero_grad()
                yield

    return model, epoch_steps


def whole_epochs(epoch_steps: Callable[[int], Iterator[None]]) -> Callable[[int], None]:
    """An epoch run to its end, from its steps."""

    def run_epoch(epoch: int) -> None:
        for _ in epoch_steps(epoch):
            pass

    return run_epoch


def hand_written(ctx: Rank, row: Row, data: TensorDataset, warmup: int, epochs: int) -> Sample:
    """``hand_loop`` in a process group of its own."""
    assert_stock()
    store = dist.PrefixStore(f"hand/{next(ctx.generation)}", ctx.store)
    dist.init_process_group("gloo", store=store, rank=ctx.rank, world_size=ctx.world)
    try:
        model, run_epoch = hand_loop(row, data)
        return timed_epochs(ctx, row, REF, model, run_epoch, warmup, epochs)
    finally:
        # Free DDP's reducer while the group is still registered, so that destroying the group
        # (which releases the GIL) and not the reducer (which does not) ends its threads.
        model = run_epoch = None  # type: ignore[assignment]
        gc.collect()
        dist.destroy_process_group()


def accel_scopes(row: Row) -> ExitStack:
    """The scopes of a row, entered: ``distributed()`` (+ ``mixed_precision``, ``accumulate``)."""
    scopes = ExitStack()
    scopes.enter_context(distributed())
    if row.mode in DTYPES:
        scopes.enter_context(mixed_precision(row.mode))
    if row.mode == "accum4":
        scopes.enter_context(accumulate(ACCUMULATE))
    return scopes


def accel_loop(row: Row, data: TensorDataset, fresh: bool = True
               ) -> tuple[nn.Module, Callable[[int], None]]:
    """The plain loop, unchanged, as it runs inside accel_ctx's scopes."""
    model, epoch_steps = accel_steps(row, data, fresh)
    return model, whole_epochs(epoch_steps)


def accel_steps(row: Row, data: TensorDataset, fresh: bool = True
                ) -> tuple[nn.Module, Callable[[int], Iterator[None]]]:
    """``accel_loop``'s model and epoch, the epoch pausing after each optimizer step."""
    model = make_model(row.model)
    net = compiled(row, model, fresh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loader = DataLoader(data, batch_size=BATCH, shuffle=True)
    loss_of = loss_for(row.model)

    def epoch_steps(epoch: int) -> Iterator[None]:
        for x, y in loader:
            loss = loss_of(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            yield

    # The same loop, paused per real step. Two copies rather than one with a step count: the
    # hand-written fp32 loop counts nothing per batch, so neither does this one's.
    def epoch_groups(epoch: int) -> Iterator[None]:
        for i, (x, y) in enumerate(loader):
            loss = loss_of(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if (i + 1) % ACCUMULATE == 0:
                yield

    return model, epoch_groups if row.mode == "accum4" else epoch_steps


def with_accel_ctx(ctx: Rank, row: Row, data: TensorDataset, warmup: int, epochs: int) -> Sample:
    """The plain loop inside accel_ctx's scopes (which form their own group)."""
    with accel_scopes(row):
        model, run_epoch = accel_loop(row, data)
        return timed_epochs(ctx, row, ACCEL, model, run_epoch, warmup, epochs)


SIDES = {REF: hand_written, ACCEL: with_accel_ctx}


# ------------------------------------------------------------------------------------------------
# watching blocks: --profile and --check
# ------------------------------------------------------------------------------------------------
@contextmanager
def profiling(profiler: cProfile.Profile) -> Iterator[None]:
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()


class Profiles:
    """``--profile``: a cProfile per row and side on rank 0, and the optimizer steps it saw."""

    def __init__(self) -> None:
        self.profiles: dict[tuple[Row, str], cProfile.Profile] = {}
        self.steps: Counter[tuple[Row, str]] = Counter()

    def observe(self, row: Row, side: str, model: nn.Module, steps: int) -> Any:
        key = (row, side if side == ACCEL else REF)
        self.steps[key] += steps
        return profiling(self.profiles.setdefault(key, cProfile.Profile()))

    def finish(self, path: str, rows: tuple[Row, ...], report: Callable[..., None]) -> None:
        """Report Python calls per step; dump each row's profiles to ``path.<row>.<side>``
        and the accel_ctx side's, all rows together, to ``path``."""
        accel = None
        for (row, side), profile in self.profiles.items():
            stats = pstats.Stats(profile)
            report("calls", rows.index(row), side, stats.total_calls / self.steps[(row, side)])
            stats.dump_stats(f"{path}.{row.name.replace(' ', '-')}.{SIDE_FILES[side]}")
            if side == ACCEL:
                accel = pstats.Stats(profile) if accel is None else accel.add(profile)
        if accel is not None:
            accel.dump_stats(path)


@contextmanager
def counting(model: nn.Module, counts: Counter[str]) -> Iterator[None]:
    """Count the collectives run (torch's profiler) and the optimizer steps that changed a weight."""
    weight = list(model.parameters())[-1]  # the head's: a deep stack's first layers barely move
    before: list[torch.Tensor] = []

    def pre(optimizer: Any, args: Any, kwargs: Any) -> None:
        before[:] = [weight.detach().clone()]

    def post(optimizer: Any, args: Any, kwargs: Any) -> None:
        if before and not torch.equal(before.pop(), weight):
            counts["optimizer steps (real)"] += 1

    hooks = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            yield
    finally:
        for hook in hooks:
            hook.remove()
    for event in prof.key_averages():
        if event.key.startswith("gloo:") or event.key.startswith("c10d::"):
            counts[event.key] += event.count


def row_data(ctx: Rank, row: Row) -> TensorDataset:
    """The in-memory data of a row: every rank's batches of one epoch, shaped for its model."""
    return make_data_for(row.model, ctx.world * BATCH * row.batches_per_epoch)


def check_rows(ctx: Rank, settings: Settings, report: Callable[..., None]) -> None:
    for index, row in enumerate(settings.rows):
        data = row_data(ctx, row)
        for side in (REF, ACCEL):
            counts: Counter[str] = Counter()
            ctx.observe = lambda r, s, m, n, counts=counts: counting(m, counts)  # type: ignore[misc]
            SIDES[side](ctx, row, data, 1, 2)
            report("check", index, side, dict(counts))


# ------------------------------------------------------------------------------------------------
# one rank
# ------------------------------------------------------------------------------------------------
def run_rows(ctx: Rank, settings: Settings, report: Callable[..., None]) -> None:
    for index, row in enumerate(settings.rows):
        data = row_data(ctx, row)
        # A warm-up pair, discarded: first-call costs of both sides, and the block length.
        epochs = 1
        if settings.calibrate or index == 0:
            probe = hand_written(ctx, row, data, settings.warmup_epochs, 1)
            with_accel_ctx(ctx, row, data, settings.warmup_epochs, 1)
            if settings.calibrate:
                seconds_per_epoch = probe.wall * row.opt_steps_per_epoch
                epochs = calibrate(seconds_per_epoch, settings.block_seconds, 1, settings.max_epochs)
        # Everything alive now is long-lived: keep the collector from walking torch's objects
        # at every block boundary (160 ms a full collection here) or in the middle of a block.
        gc.collect()
        gc.freeze()
        report("epochs", index, epochs, None)
        for block in plan(settings.pairs):
            side = SIDES[ACCEL if block.side == ACCEL else REF]
            gc.collect()  # the previous block's garbage, outside every timed region
            report("sample", index, block, side(ctx, row, data, settings.warmup_epochs, epochs))


def run_rows_interleaved(ctx: Rank, settings: Settings, report: Callable[..., None]) -> None:
    """``--interleaved``: one process group, formed by hand as a DDP script forms it, and three
    loops alive side by side per row: the hand-written one twice (A, and A2 for the noise floor)
    and the plain loop (B), whose scopes are entered around each of its blocks and adopt that
    group. A pair's two blocks run a fraction of a second apart, so the machine's drift over
    seconds (most of the spread of ``run_rows``' pairs, with a new group, model and compile per
    block) cancels within the pair. Each model is compiled once, in its first block."""
    for index, row, data in rows_in_one_group(ctx, settings, "interleaved"):
        loops = {REF: hand_loop(row, data, fresh=False), REF2: hand_loop(row, data, fresh=False),
                 ACCEL: accel_loop(row, data, fresh=False)}
        interleaved_row(ctx, settings, report, index, row, loops)
        loops.clear()  # collected before the next row (rows_in_one_group)


def rows_in_one_group(ctx: Rank, settings: Settings, name: str
                      ) -> Iterator[tuple[int, Row, TensorDataset]]:
    """Each row with its data, in one process group formed by hand as a DDP script forms it;
    Dynamo reset before a row (its models compile afresh), its garbage collected after it."""
    store = dist.PrefixStore(name, ctx.store)
    dist.init_process_group("gloo", store=store, rank=ctx.rank, world_size=ctx.world)
    try:
        for index, row in enumerate(settings.rows):
            data = row_data(ctx, row)
            torch._dynamo.reset()
            yield index, row, data
            gc.unfreeze()
            gc.collect()  # the row's loops, which the caller dropped
    finally:
        dist.destroy_process_group()


def interleaved_row(ctx: Rank, settings: Settings, report: Callable[..., None], index: int,
                    row: Row, loops: dict[str, tuple[nn.Module, Callable[[int], None]]]) -> None:
    def block(side: str, epochs: int) -> Sample:
        model, run_epoch = loops[side]
        if side != ACCEL:
            assert_stock()
            return timed_epochs(ctx, row, side, model, run_epoch, settings.warmup_epochs, epochs)
        with accel_scopes(row):
            return timed_epochs(ctx, row, side, model, run_epoch, settings.warmup_epochs, epochs)

    probe = block(REF, 1)  # first blocks compile; the block length from the hand-written one
    block(ACCEL, 1)
    block(REF2, 1)
    epochs = calibrate(probe.wall * row.opt_steps_per_epoch, settings.block_seconds, 1,
                       settings.max_epochs)
    gc.collect()
    gc.freeze()
    report("epochs", index, epochs, None)
    for each in plan(settings.pairs):
        gc.collect()
        report("sample", index, each, block(each.side, epochs))


# all six orders of the three sides, in turn: no side keeps a place in the sequence
TURN_ORDERS = tuple(itertools.permutations((REF, ACCEL, REF2)))


def run_rows_step_pairs(ctx: Rank, settings: Settings, report: Callable[..., None]) -> None:
    """``--step-pairs``: one process group as with ``--interleaved``, the three loops alive side
    by side, taking turns at every optimizer step, in all six orders in turn. Every rank starts
    each step at once (an untimed barrier), and a step's wall time is its slowest rank's. The
    hand-written steps run on stock PyTorch: accel_ctx's patches are taken out around each of
    them (untimed) and the scopes' state is out of their sight (a context of their own). A pair
    is the mean per step of ``steps`` turns of each side, so a row's pairs are seconds apart
    where blocks are, but each pair's sides ran interleaved within milliseconds: the drift of
    the machine cancels, and the epoch starts (accel_ctx's broadcast) are in the means."""
    for index, row, data in rows_in_one_group(ctx, settings, "step-pairs"):
        loops = {REF: hand_steps(row, data, fresh=False),
                 REF2: hand_steps(row, data, fresh=False),
                 ACCEL: accel_steps(row, data, fresh=False)}
        turns = {side: _endless(epoch_steps) for side, (_, epoch_steps) in loops.items()}
        with accel_scopes(row):  # open throughout; the hand-written turns step out of it
            step_pairs_row(ctx, settings, report, index, row, turns)
        loops.clear()  # collected before the next row (rows_in_one_group)
        turns.clear()


def _endless(epoch_steps: Callable[[int], Iterator[None]]) -> Iterator[None]:
    for epoch in itertools.count():
        yield from epoch_steps(epoch)


def step_pairs_row(ctx: Rank, settings: Settings, report: Callable[..., None], index: int,
                   row: Row, turns: dict[str, Iterator[None]]) -> None:
    from accel_ctx._hooks import patches  # the benchmark's own switch: stock torch for side A

    own_contexts = {side: contextvars.Context() for side in (REF, REF2)}

    def turn(side: str) -> tuple[float, float]:
        if side == ACCEL:
            dist.barrier()
            with Timer() as timer:
                next(turns[side])
            return timer.wall, timer.cpu
        held = 0
        while patches.installed():  # one hold per open scope
            patches.release()
            held += 1
        try:
            assert_stock()
            dist.barrier()
            with Timer() as timer:
                own_contexts[side].run(next, turns[side])
        finally:
            for _ in range(held):
                patches.acquire()
        return timer.wall, timer.cpu

    warmup = settings.warmup_epochs * row.opt_steps_per_epoch
    for order in itertools.islice(itertools.cycle(TURN_ORDERS), warmup):  # compiles first
        for side in order:
            turn(side)
    probe = [turn(REF)[0] for _ in range(8)]
    agreed = torch.tensor([calibrate(sorted(probe)[4], settings.block_seconds, 6, 10_000)])
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)  # every rank takes as many turns
    steps = int(agreed.item())
    steps -= steps % len(TURN_ORDERS)
    report("steps", index, steps, None)
    gc.collect()
    gc.freeze()
    orders = itertools.cycle(TURN_ORDERS)
    for pair in range(settings.pairs):
        gc.collect()
        times: dict[str, list[tuple[float, float]]] = {REF: [], ACCEL: [], REF2: []}
        for order in itertools.islice(orders, steps):
            for side in order:
                times[side].append(turn(side))
        for side, kinds in ((REF, ("AB", "AA")), (ACCEL, ("AB",)), (REF2, ("AA",))):
            wall = torch.tensor([w for w, _ in times[side]], dtype=torch.float64)
            cpu = torch.tensor([c for _, c in times[side]], dtype=torch.float64)
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # each step's slowest rank
            dist.all_reduce(cpu, op=dist.ReduceOp.SUM)
            sample = Sample(wall.mean().item(), cpu.mean().item() / ctx.world)
            typical = Sample(wall.median().item(), cpu.median().item() / ctx.world)
            for kind in kinds:
                report("sample", index, Block(pair, kind, side), sample)
                report("typical", index, Block(pair, kind, side), typical)


def worker(rank: int, world: int, tmp: str, settings: Settings, results: Any) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world), ACCEL_CTX_INIT_METHOD=f"file://{tmp}/accel-store",
    )
    torch.set_num_threads(1)
    # The two sides draw their batches in different orders (DistributedSampler's and
    # accel_ctx's), so their weights part after the first step, and so does the number of
    # subnormal floats they meet: x86 computes on those many times slower. A compiled deep200
    # step measured 21 % slower on one side or 9 % faster, by that alone. Flushing them to zero
    # on both sides leaves the frameworks' own cost in the comparison.
    torch.set_flush_denormal(True)
    assert_stock()  # captures the stock entry points before any scope opens

    def report(*message: Any) -> None:
        if rank == 0:  # timings are agreed between the ranks; counts are rank 0's
            results.put(message)

    try:
        ctx = Rank(rank, world, f"{tmp}/hand-store")
        if settings.check:
            check_rows(ctx, settings, report)
        else:
            profiles = Profiles() if settings.profile and rank == 0 else None
            if profiles is not None:
                ctx.observe = profiles.observe
            drive = (run_rows_step_pairs if settings.step_pairs
                     else run_rows_interleaved if settings.interleaved else run_rows)
            drive(ctx, settings, report)
            if profiles is not None and settings.profile is not None:
                profiles.finish(settings.profile, settings.rows, report)
        results.put(("done", rank, None, None))
    except BaseException:
        results.put(("error", rank, traceback.format_exc(), None))


# ------------------------------------------------------------------------------------------------
# the parent
# ------------------------------------------------------------------------------------------------
def run(settings: Settings, world: int, timeout: float) -> Iterator[tuple[str, int, Any, Any]]:
    """Start the ranks and yield what rank 0 reports until every rank is done."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="accel-ctx-bench-") as tmp:
        procs = [
            ctx.Process(target=worker, args=(r, world, tmp, settings, results))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        done: set[int] = set()
        deadline = time.monotonic() + timeout
        try:
            while len(done) < world:
                if time.monotonic() > deadline:
                    raise SystemExit(f"step_time: ranks {set(range(world)) - done} timed out")
                try:
                    kind, a, b, c = results.get(timeout=1.0)
                except queue.Empty:
                    dead = [p for p in procs if p.exitcode not in (None, 0)]
                    if dead:
                        raise SystemExit(
                            f"step_time: a rank died (exit code {dead[0].exitcode})"
                        ) from None
                    continue
                if kind == "error":
                    raise SystemExit(f"step_time: rank {a} failed:\n{b}")
                if kind == "done":
                    done.add(a)
                    continue
                yield kind, a, b, c
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()


def print_checks(settings: Settings, world: int) -> int:
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # quieter profiler in the ranks
    counts: dict[int, dict[str, dict[str, int]]] = {}
    for _, index, side, found in run(settings, world, timeout=900.0):
        counts.setdefault(index, {})[side] = found
    print("work done by rank 0 in 2 epochs (after 1 warm-up epoch), hand-written vs accel_ctx")
    status = 0
    for index, row in enumerate(settings.rows):
        ref, accel = counts[index][REF], counts[index][ACCEL]
        print(f"  {row.name}")
        for key in sorted(set(ref) | set(accel)):
            same = ref.get(key, 0) == accel.get(key, 0)
            must_match = "all_reduce" in key or "optimizer steps" in key
            flag = "" if same else ("   <-- MISMATCH" if must_match else "   (differs)")
            status |= int(must_match and not same)
            print(f"    {key:<34} {ref.get(key, 0):>6} {accel.get(key, 0):>6}{flag}")
    print("check: " + ("same gradient all-reduces and optimizer steps on both sides" if status == 0
                       else "the two sides do not do the same work"))
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 pairs, one short epoch per block (figures are noise)")
    parser.add_argument("--pairs", type=int, help="alternating pairs per row (default 6; quick 2)")
    parser.add_argument("--block-seconds", type=float,
                        help="target length of one timed block (default 0.4)")
    parser.add_argument("--models", default="mlp,deep200",
                        help="comma list: mlp, gpt (a small GPT), deepN (a stack of ~N tiny "
                             "modules)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma list of {MODES}")
    parser.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--profile", metavar="FILE",
                        help="cProfile rank 0's blocks: Python calls per step of both sides, "
                        "the accel_ctx side's profile into FILE (timings then invalid)")
    parser.add_argument("--compile", action="store_true",
                        help="both sides call torch.compile(model) (inductor; compiled in warm-up)")
    parser.add_argument("--check", action="store_true",
                        help="count collectives and real optimizer steps per side; no timing")
    parser.add_argument("--interleaved", action="store_true",
                        help="one process group and all loops alive side by side, alternating "
                        "blocks a fraction of a second apart (see run_rows_interleaved)")
    parser.add_argument("--step-pairs", action="store_true",
                        help="one process group, the loops taking turns at every optimizer step; "
                        "a pair is --block-seconds of turns per side (see run_rows_step_pairs)")
    args = parser.parse_args(argv)
    modes = tuple(m for m in args.modes.split(",") if m)
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    quick = args.quick
    settings = Settings(
        pairs=args.pairs or (2 if quick else 6),
        block_seconds=args.block_seconds or 0.4,
        calibrate=not quick or args.block_seconds is not None,
        warmup_epochs=1,
        max_epochs=100,
        rows=tuple(
            Row(m, mode, 8 if quick else 32, args.compile)
            for m in args.models.split(",") if m for mode in modes
        ),
        profile=args.profile,
        check=args.check,
        interleaved=args.interleaved,
        step_pairs=args.step_pairs,
    )
    torch.set_num_threads(1)
    if settings.check:
        return print_checks(settings, args.world)
    length = (f"~{settings.block_seconds:g} s per timed block" if settings.calibrate
              else "one epoch per timed block")
    print(f"step_time: {args.world} ranks (gloo, CPU), per-rank batch {BATCH}, "
          f"{settings.rows[0].batches_per_epoch} batches per rank and epoch, {settings.pairs} "
          f"pairs per row, {length}; torch {torch.__version__}, {os.cpu_count()} CPUs",
          flush=True)
    start = time.perf_counter()
    comparisons = [Comparison(row.name) for row in settings.rows]
    typical = [Comparison(row.name) for row in settings.rows]
    calls: dict[int, dict[str, float]] = {}
    for kind, index, block, sample in run(settings, args.world, timeout=1800.0):
        name = comparisons[index].name
        if kind in ("epochs", "steps"):
            print(f"  {name:<22} {block} {kind} per timed block{' and side' if kind == 'steps' else ''}",
                  file=sys.stderr, flush=True)
            continue
        if kind == "calls":
            calls.setdefault(index, {})[block] = sample
            continue
        if kind == "typical":
            typical[index].add(block, sample)
            continue
        comparisons[index].add(block, sample)
        print(f"  {name:<22} pair {block.pair} {block.kind} {block.side:<2} "
              f"{sample.wall * 1e3:8.3f} ms/step wall {sample.cpu * 1e3:8.3f} ms/step cpu",
              file=sys.stderr, flush=True)
    print(table(comparisons, "optimizer step", TARGET))
    if settings.step_pairs:
        print("\nthe median step of each pair instead of the mean (leaves out the epoch starts)")
        print(table(typical, "optimizer step", TARGET))
    print(f"({time.perf_counter() - start:.0f} s)")
    if args.profile:
        print("\nPython function calls per optimizer step under cProfile (rank 0; deterministic,"
              " unlike the times above, which cProfile inflates):")
        print(f"  {'row':<22} {'hand-written':>12} {'accel_ctx':>10} {'extra':>7}")
        for index, per_side in sorted(calls.items()):
            ref, accel = per_side.get(REF, 0.0), per_side.get(ACCEL, 0.0)
            print(f"  {comparisons[index].name:<22} {ref:>12.0f} {accel:>10.0f} {accel - ref:>+7.0f}")
        print(f"\ncProfile of rank 0's accel_ctx blocks ({args.profile}), by internal time:")
        pstats.Stats(args.profile).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
