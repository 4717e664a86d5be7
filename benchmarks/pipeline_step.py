"""What ``distributed(pp=2, microbatches=M)`` costs per step, and what it saves in memory per
rank, against one process cutting each batch into the same micro-batches by hand.

A transformer of 4 blocks shaped like ``tests/workers/pipeline.py``'s ``LM`` (width 256, 4
heads, an MLP of twice the width, learned positions, a final LayerNorm and an untied head;
sequence 64, vocabulary 512: 2.4M parameters) trains on random tokens, batch 8, AdamW,
``clip_grad_norm_(model.parameters(), 1.0)``, fp32, with the plain loop (forward,
cross-entropy, backward, clip, step, ``zero_grad``):

- one process (the reference, A): no scope, the batch cut by hand,
  ``torch.cat([model(c) for c in x.tensor_split(M)])``;
- ``pp`` (B): two processes (spawned, gloo on CPU), the same loop inside
  ``distributed(pp=2, microbatches=M)``, ``model(x)``; stage 0 holds the embeddings and blocks
  0-1, stage 1 blocks 2-3, the norm and the head.

Every block is a fresh process (or pair), one thread each (``OMP_NUM_THREADS=1``); it builds
the model, trains 2 untimed steps (the pipeline's cut is made at the first; AdamW's state at
the first step), then times ``--steps`` steps (per-step median; pp: the slower rank's). Rounds
alternate the sides' order; a ratio is the geometric mean over rounds of pp / one process,
beside the A/A floor (the one-process side run twice in each round). CPU time per step is the
process's (pp: both ranks' summed). Each step is also timed in three phases (forward and
loss, backward, clip + step + ``zero_grad``), per rank.

Memory, per rank, measured at the second untimed step: the bytes of parameters, gradients and
AdamW's state (``numel * element_size`` over ``model.parameters()``, their ``.grad`` and the
tensors of ``opt.state``, after ``opt.step()``), and the activation bytes the forward saves for
the backward (``torch.autograd.graph.saved_tensors_hooks``: every saved tensor's storage once,
parameters left out; torch keeps no allocator statistics on the CPU). Under GPipe every
micro-batch's activations are alive at the end of the forward, as they are in the one process
that cuts the batch by hand, so that sum is the peak of the saved tensors on both sides.

On 2 cores the two stages run in parallel processes, one per core, while the one process uses
one core: a wall ratio below 1 is the second core's work, not a free speed-up, 1/2 would be a
perfect split, and what the ratio keeps above 1/2 is what the pipeline's bubble and its
point-to-point traffic (gloo, loopback) leave. In this engine the backward has no overlap:
stage 1 sends the gradients of every micro-batch at the end of its backward, and stage 0's
starts when they arrive (the phase table shows it).

    python benchmarks/pipeline_step.py              # ~1.5-2 min on 2 cores
    python benchmarks/pipeline_step.py --quick      # ~30 s, a smoke run: its figures mean nothing
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import contextlib
import math
import multiprocessing as mp
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

VOCAB, WIDTH, HEADS, BLOCKS, LENGTH, BATCH = 512, 256, 4, 4, 64, 8
SIDES = ("one", "pp", "one2")  # A, B, A2


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (p.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for p in self.qkv(self.ln1(x)).split(c, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))  # type: ignore[no-any-return]


class LM(nn.Module):
    def __init__(self, vocab: int, width: int, heads: int, blocks: int, length: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(length, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(blocks))
        self.ln_f, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    @override
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # type: ignore[no-any-return]


def _state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Parameters + gradients + the optimizer's state, in bytes (this rank's)."""
    total = 0
    for p in model.parameters():
        total += p.numel() * p.element_size()
        if p.grad is not None:
            total += p.grad.numel() * p.grad.element_size()
    for per_param in opt.state.values():
        for t in per_param.values():
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def _worker(rank: int, world: int, side: str, micro: int, shape: dict[str, int], steps: int,
            store: str, out: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), ACCEL_CTX_INIT_METHOD=f"file://{store}")
    torch.set_num_threads(1)
    pipeline = side == "pp"
    if pipeline:
        from accel_ctx import distributed  # its import is not the step's cost
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, shape["vocab"], (shape["batch"] * (steps + 2), shape["length"] + 1),
                         generator=g)
    torch.manual_seed(0)  # the user's script: seed before the scopes
    scope = distributed(pp=world, microbatches=micro) if pipeline else contextlib.nullcontext()
    times: list[float] = []
    cpu: list[float] = []
    phases: list[tuple[float, float, float]] = []  # forward + loss, backward, the rest
    saved: dict[int, int] = {}
    state, loss = 0, 0.0
    with scope:
        model = LM(shape["vocab"], shape["width"], shape["heads"], shape["blocks"],
                   shape["length"])
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=shape["batch"])
        weights: set[int] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in weights:
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        for i, (x, y) in enumerate(loader):
            measure = i == 1  # the second untimed step: this stage's parameters, AdamW's state
            if measure:
                weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
            hooks = (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if measure
                     else contextlib.nullcontext())
            wall, proc = time.perf_counter(), time.process_time()
            with hooks:
                out_ = (model(x) if pipeline
                        else torch.cat([model(c) for c in x.tensor_split(micro)]))
                loss_ = F.cross_entropy(out_.flatten(0, 1), y.flatten())
            forward = time.perf_counter()
            loss_.backward()  # type: ignore[no-untyped-call]
            backward = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if measure:
                state = _state_bytes(model, opt)
            opt.zero_grad()
            if i >= 2:  # two warm-up steps: the pipeline cut, AdamW's state made
                end = time.perf_counter()
                times.append(end - wall)
                cpu.append(time.process_time() - proc)
                phases.append((forward - wall, backward - forward, end - backward))
            loss = loss_.item()
    split = [statistics.median(p[k] for p in phases) for k in range(3)]
    out.put((rank, statistics.median(times), statistics.median(cpu), state,
             sum(saved.values()), loss, split))


def run(side: str, micro: int, shape: dict[str, int], steps: int) -> dict[str, float]:
    """One block: a fresh process (one process) or pair (pp=2); the slower rank's step."""
    world = 2 if side == "pp" else 1
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, world, side, micro, shape, steps,
                                                   f"{tmp}/store", out)) for r in range(world)]
        for p in procs:
            p.start()
        got = sorted(out.get(timeout=600) for _ in procs)  # by rank
        for p in procs:
            p.join()
    return {"ms": max(g[1] for g in got) * 1e3, "cpu": sum(g[2] for g in got) * 1e3,
            "state": [g[3] for g in got], "saved": [g[4] for g in got], "loss": got[-1][5],
            "phases": [g[6] for g in got]}


def _geo(pairs: list[tuple[float, float]]) -> float:
    return math.exp(statistics.mean(math.log(b / a) for a, b in pairs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--micro", default="2,4", help="micro-batch counts, comma-separated")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    shape = {"vocab": VOCAB, "width": WIDTH, "heads": HEADS, "blocks": BLOCKS,
             "length": LENGTH, "batch": BATCH}
    if args.quick:
        shape.update(vocab=64, width=32, length=16)
    rounds, steps = (1, 2) if args.quick else (args.rounds, args.steps)
    micros = [int(m) for m in args.micro.split(",")]
    params = sum(p.numel() for p in LM(shape["vocab"], shape["width"], shape["heads"],
                                       shape["blocks"], shape["length"]).parameters())
    print(f"LM {params / 1e6:.2f}M parameters ({shape['blocks']} blocks of width "
          f"{shape['width']}, {shape['heads']} heads, sequence {shape['length']}, vocabulary "
          f"{shape['vocab']}), batch {shape['batch']}, AdamW, clip 1.0, fp32; one thread per "
          f"process; {rounds} rounds x {steps} timed steps (after 2 untimed)")
    results: dict[tuple[int, str], list[dict[str, Any]]] = {}
    started = time.perf_counter()
    for r in range(rounds):
        for micro in micros:
            for side in (SIDES if r % 2 == 0 else tuple(reversed(SIDES))):
                results.setdefault((micro, side), []).append(run(side, micro, shape, steps))
    print(f"({time.perf_counter() - started:.0f} s)\n")
    print("Step time: pp=2 (2 processes, one core each) vs one process (one core) cutting the "
          "batch by hand; ratio = geometric mean over rounds, A/A = one process vs itself")
    print("| microbatches | one process ms | pp=2 ms | ratio wall | A/A wall | one process CPU ms "
          "| pp=2 CPU ms (both ranks) | ratio CPU | A/A CPU | last loss one / pp | rounds |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for micro in micros:
        a, b, a2 = (results[(micro, s)] for s in SIDES)

        def med(rows: list[dict[str, Any]], key: str) -> float:
            return float(statistics.median(row[key] for row in rows))

        def geo(x: list[dict[str, Any]], y: list[dict[str, Any]], key: str) -> float:
            return _geo([(p[key], q[key]) for p, q in zip(x, y, strict=True)])

        print(f"| {micro} | {med(a, 'ms'):.1f} | {med(b, 'ms'):.1f} | {geo(a, b, 'ms'):.3f} | "
              f"{geo(a, a2, 'ms'):.3f} | {med(a, 'cpu'):.1f} | {med(b, 'cpu'):.1f} | "
              f"{geo(a, b, 'cpu'):.3f} | {geo(a, a2, 'cpu'):.3f} | {a[-1]['loss']:.5f} / "
              f"{b[-1]['loss']:.5f} | {len(a)} |")
    print("\nMemory per rank (MiB): parameters + gradients + AdamW state after a step; "
          "activation bytes saved for the backward by one forward (+ loss)")
    print("| microbatches | one process state | stage 0 state | stage 1 state | ratios | "
          "one process saved | stage 0 saved | stage 1 saved | ratios |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    mib = 2**20
    for micro in micros:
        one, pp = results[(micro, "one")][-1], results[(micro, "pp")][-1]
        (s1,), (s0, s_1) = one["state"], pp["state"]
        (v1,), (v0, v_1) = one["saved"], pp["saved"]
        print(f"| {micro} | {s1 / mib:.2f} | {s0 / mib:.2f} | {s_1 / mib:.2f} | "
              f"{s0 / s1:.3f} / {s_1 / s1:.3f} | {v1 / mib:.2f} | {v0 / mib:.2f} | "
              f"{v_1 / mib:.2f} | {v0 / v1:.3f} / {v_1 / v1:.3f} |")
    print("\nWhere a step's time goes (ms, per-step medians, median over rounds): forward + "
          "loss / backward / clip + step + zero_grad")
    print("| microbatches | one process | stage 0 | stage 1 |")
    print("| --- | --- | --- | --- |")
    for micro in micros:
        one_rows, pp_rows = results[(micro, "one")], results[(micro, "pp")]
        cells = [[statistics.median(row["phases"][rank][k] for row in rows) * 1e3
                  for k in range(3)] for rows, rank in ((one_rows, 0), (pp_rows, 0), (pp_rows, 1))]
        print(f"| {micro} | " + " | ".join(" / ".join(f"{v:.1f}" for v in c) for c in cells) + " |")
    print("\nOn 2 cores the two stages run in parallel processes, one core each, against one "
          "process on one core:\na wall ratio under 1 is the second core's work (1/2 would be a "
          "perfect split); what it keeps above 1/2\nis what the pipeline's bubble and its "
          "point-to-point traffic leave (stage 0 waits for the whole output after its forwards,\n"
          "and for the first gradient before its backward). The CPU ratio "
          "is both ranks'\nextra work. A loaded machine moves the pp side most (it needs both "
          "cores at once).")


if __name__ == "__main__":
    main()
