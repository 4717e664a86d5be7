"""DeepSpeed ZeRO behind the plain loop: step time and memory per rank of
``sharded(engine="deepspeed", stage=1|2|3)`` beside ``distributed()`` (DDP) and ``sharded()``
(FSDP2), and beside DeepSpeed written by hand (ZeRO-2: ``engine(x)``, ``engine.backward``,
``engine.step``), on the same model.

Two ranks (spawned processes, gloo on CPU, one thread each) train a GPT-shaped model
(``_models.GPT``; 6 blocks of width 384, vocabulary 8192: ~14M parameters) on random tokens,
sequence 64, batch 2 per rank, AdamW, ``clip_grad_norm_(model.parameters(), 1.0)``. Every block
is a fresh pair of processes: it builds the model inside the scopes, trains 2 steps untimed
(DeepSpeed's engine is built at the first), then times ``--steps`` steps (wall: the slowest
rank's per-step median). Rounds alternate the sides' order; a ratio is the geometric mean over
rounds of side / DDP, beside the A/A floor (DDP run twice in each round). Memory: each rank's
peak RSS (``ru_maxrss``) after the steps, and its RSS before the model was built (Python,
torch, DeepSpeed's import).

    python benchmarks/deepspeed_step.py              # ~5 min on 2 cores
    python benchmarks/deepspeed_step.py --quick      # a smoke run: its figures mean nothing
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # peaks of tensors, not of the heap

import argparse
import contextlib
import math
import multiprocessing as mp
import resource
import socket
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from _models import GPTConfig, make_gpt, make_tokens, parameter_count
from torch.utils.data import DataLoader

BATCH = 2
SIDES = ("ddp", "ddp2", "fsdp2", "zero1", "zero2", "zero3", "hand_zero2")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _loop(model: Any, opt: Any, loader: Any, steps: int, step: Any) -> tuple[list[float], float]:
    times, loss = [], 0.0
    for i, (x, y) in enumerate(loader):
        if i == steps + 2:
            break
        start = time.perf_counter()
        loss = step(x, y)
        if i >= 2:  # two warm-up steps: the engine built, AdamW's state made
            times.append(time.perf_counter() - start)
    return times, loss


def _worker(rank: int, side: str, cfg: GPTConfig, steps: int, port: int, out: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from accel_ctx import distributed, sharded

    if side.startswith(("zero", "hand")):
        import deepspeed  # its import is not the step's cost
    base = _rss_mb()
    data = make_tokens(cfg, BATCH * 2 * (steps + 2))

    def plain_step(model: Any, opt: Any) -> Any:
        def step(x: torch.Tensor, y: torch.Tensor) -> float:
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss)
        return step

    if side == "hand_zero2":
        import deepspeed

        dist.init_process_group("gloo")
        model = make_gpt(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_clipping": 1.0,
                  "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
                  "steps_per_print": 2**62}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        mine = [i for b in range(rank, len(data) // BATCH, 2)
                for i in range(b * BATCH, (b + 1) * BATCH)]

        def step(x: torch.Tensor, y: torch.Tensor) -> float:
            loss = F.cross_entropy(engine(x).flatten(0, 1), y.flatten())
            engine.backward(loss)
            engine.step()
            return float(loss)

        times, loss = _loop(engine, opt, DataLoader(data, batch_size=BATCH, sampler=mine),
                            steps, step)
        dist.destroy_process_group()
    else:
        with contextlib.ExitStack() as scopes:
            scopes.enter_context(distributed())
            if side == "fsdp2":
                scopes.enter_context(sharded())
            elif side.startswith("zero"):
                scopes.enter_context(sharded(engine="deepspeed", stage=int(side[-1])))
            model = make_gpt(cfg)
            opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
            times, loss = _loop(model, opt, DataLoader(data, batch_size=BATCH), steps,
                                plain_step(model, opt))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out.put((rank, statistics.median(times), peak, base, loss))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(side: str, cfg: GPTConfig, steps: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, side, cfg, steps, port, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = sorted(out.get(timeout=900) for _ in procs)  # by rank: the loss shown is rank 0's
    for p in procs:
        p.join()
    return {"ms": max(g[1] for g in got) * 1e3, "peak": max(g[2] for g in got),
            "base": max(g[3] for g in got), "loss": got[0][4]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    cfg = (GPTConfig(vocab=512, seq=16, width=64, layers=2, heads=2) if args.quick
           else GPTConfig(vocab=8192, seq=64, width=384, layers=6, heads=6))
    rounds, steps = (1, 3) if args.quick else (args.rounds, args.steps)
    print(f"GPT {parameter_count(make_gpt(cfg)) / 1e6:.1f}M parameters, 2 ranks (gloo), batch "
          f"{BATCH} x seq {cfg.seq} per rank, AdamW, clip 1.0; {rounds} rounds x {steps} steps")
    results: dict[str, list[dict[str, float]]] = {s: [] for s in SIDES}
    for r in range(rounds):
        for side in (SIDES if r % 2 == 0 else tuple(reversed(SIDES))):
            results[side].append(run(side, cfg, steps))
    ddp = results["ddp"]
    print("| side | ms/step (median of rounds) | ratio vs DDP (geo. mean) | A/A (DDP twice) "
          "| peak RSS MB per rank | RSS before the model MB | last loss |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    floor = math.exp(statistics.mean(math.log(b["ms"] / a["ms"])
                                     for a, b in zip(ddp, results["ddp2"], strict=True)))
    for side in SIDES:
        rows = results[side]
        ratio = math.exp(statistics.mean(math.log(b["ms"] / a["ms"])
                                         for a, b in zip(ddp, rows, strict=True)))
        print(f"| {side} | {statistics.median(r['ms'] for r in rows):.1f} | {ratio:.3f} | "
              f"{floor:.3f} | {statistics.median(r['peak'] for r in rows):.0f} | "
              f"{statistics.median(r['base'] for r in rows):.0f} | {rows[-1]['loss']:.5f} |")


if __name__ == "__main__":
    main()
