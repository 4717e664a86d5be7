"""A GPT training step on one GPU, written four ways: by hand, accel_ctx, Accelerate, Fabric.

The same loop (GPT of ``_models.GPT``, AdamW, batch x seq tokens, the loss under autocast as
torch's AMP recipe has it, GradScaler for fp16) is timed in a fresh process per side and run,
the order of the sides rotated each round (A B C D, B C D A, ...). Each process builds the
model, warms up (and compiles, with ``--compile``), then times ``--steps`` steps between two
device synchronisations. Reported per side: ms/step (median over rounds), the geometric mean of
the per-round ratio to the hand-written loop, the A/A floor (the hand-written loop run twice
per round, as two sides), MFU (6 x parameters x tokens/s over ``--peak-tflops``) and peak
memory (``torch.cuda.max_memory_allocated``; on the CPU, the process's peak RSS).

    python benchmarks/gpt_step_gpu.py                              # bf16 and fp16, eager
    python benchmarks/gpt_step_gpu.py --compile                    # and torch.compile
    python benchmarks/gpt_step_gpu.py --precision fp8 --compile    # torchao float8 (H100/H200)
    python benchmarks/gpt_step_gpu.py --device cpu --smoke         # a tiny check of the script

Accelerate and Fabric are measured when they import (``pip install accelerate lightning``).
fp8 is torchao's float8 training of the Linear layers (in and out features multiples of 16)
under bf16 autocast, by hand (``convert_to_float8_training``) and as ``mixed_precision("fp8")``;
the peers are not timed in fp8.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

SIDES = ("hand", "hand_again", "accel_ctx", "accelerate", "fabric")


def _loader(cfg: Any, batch: int, steps: int, pin: bool) -> Any:
    from _models import make_tokens
    from torch.utils.data import DataLoader

    return DataLoader(make_tokens(cfg, batch * steps), batch_size=batch, pin_memory=pin,
                      drop_last=True)


def _loss(logits: Any, y: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))


def _fp8_qualifies(module: Any, name: str) -> bool:
    """The Linear layers that mixed_precision("fp8") converts: both dims multiples of 16."""
    return bool(module.in_features % 16 == 0 and module.out_features % 16 == 0)


def _time(step: Any, loader: Any, warmup: int, sync: Any) -> float:
    batches = iter(loader)
    for _ in range(warmup):
        step(*next(batches))
    sync()
    start = time.perf_counter()
    count = 0
    for x, y in batches:
        step(x, y)
        count += 1
    sync()
    return (time.perf_counter() - start) / count


def worker(side: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from _models import GPTConfig, make_gpt, parameter_count

    device = torch.device(args.device)
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, width=args.width, layers=args.layers,
                    heads=args.heads)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}[args.precision]
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    loader = _loader(cfg, args.batch, args.warmup + args.steps, cuda)
    fused = {"fused": True}  # GradScaler hands fused kernels its scale (CUDA and CPU alike)

    if side in ("hand", "hand_again"):
        model = make_gpt(cfg).to(device)
        if args.precision == "fp8":  # torchao's recipe: convert, then the optimizer and compile
            from torchao.float8 import convert_to_float8_training

            convert_to_float8_training(model, module_filter_fn=_fp8_qualifies)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)
        net = torch.compile(model) if args.compile else model
        scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")

        def step(x: Any, y: Any) -> None:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=dtype):
                loss = _loss(net(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)

        seconds = _time(step, loader, args.warmup, sync)
    elif side == "accel_ctx":
        from accel_ctx import distributed, mixed_precision

        with distributed(device=str(device)), mixed_precision(args.precision):
            model = make_gpt(cfg)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)
            net = torch.compile(model) if args.compile else model

            def step(x: Any, y: Any) -> None:
                loss = _loss(net(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            seconds = _time(step, loader, args.warmup, sync)
    elif side == "accelerate":
        from accelerate import Accelerator

        accelerator = Accelerator(mixed_precision=args.precision, cpu=not cuda)
        model = make_gpt(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)
        model, opt, loader = accelerator.prepare(model, opt, loader)

        def step(x: Any, y: Any) -> None:
            loss = _loss(model(x), y)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)

        seconds = _time(step, loader, args.warmup, sync)
    elif side == "fabric":
        from lightning.fabric import Fabric

        precision = "bf16-mixed" if args.precision == "bf16" else "16-mixed"
        fabric = Fabric(accelerator="cuda" if cuda else "cpu", devices=1, precision=precision)
        fabric.launch()
        model = make_gpt(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)
        model, opt = fabric.setup(model, opt)
        loader = fabric.setup_dataloaders(loader)

        def step(x: Any, y: Any) -> None:
            loss = _loss(model(x), y)
            fabric.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)

        seconds = _time(step, loader, args.warmup, sync)
    else:
        raise SystemExit(f"unknown side {side!r}")
    peak = (torch.cuda.max_memory_allocated() if cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    tokens = args.batch * args.seq / seconds
    from torch._dynamo.utils import counters

    return {"ms": seconds * 1e3, "peak": peak, "tokens_per_s": tokens,
            "params": parameter_count(make_gpt(cfg)),
            "graphs": counters["stats"]["unique_graphs"],
            "breaks": sum(counters["graph_break"].values())}


def _available(side: str) -> bool:
    module = {"accelerate": "accelerate", "fabric": "lightning.fabric"}.get(side)
    if module is None:
        return True
    try:
        __import__(module)
    except Exception:
        return False
    return True


def _run(side: str, args: argparse.Namespace, compiled: bool, precision: str) -> dict[str, Any]:
    command = [sys.executable, __file__, "--worker", side, "--precision", precision,
               *(["--compile"] if compiled else []), *args.passthrough]
    path = [os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{side} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=SIDES)
    parser.add_argument("--device", default=None)
    parser.add_argument("--precision", choices=("bf16", "fp16", "fp8", "both", "all"),
                        default="both", help="both: bf16 and fp16; all: and fp8")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--only-compiled", action="store_true",
                        help="with --compile: the compiled rows alone")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="H100 SXM bf16 dense")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round")
    args = parser.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        args.rounds, args.steps, args.warmup = 1, 3, 1
        args.batch, args.seq, args.vocab, args.width, args.layers, args.heads = 2, 32, 512, 64, 2, 2
    if args.worker:
        print(json.dumps(worker(args.worker, args)))
        return
    args.passthrough = [f"--{k}={getattr(args, k.replace('-', '_'))}" for k in (
        "device", "steps", "warmup", "batch", "seq", "vocab", "width", "layers", "heads")]
    sides = [s for s in SIDES if _available(s)]
    precisions = {"both": ("bf16", "fp16"), "all": ("bf16", "fp16", "fp8")}.get(
        args.precision, (args.precision,))
    print(f"GPT {args.layers}x{args.width}, vocab {args.vocab}, batch {args.batch}x{args.seq} "
          f"on {args.device}; {args.rounds} rounds of {args.steps} steps; sides: "
          f"{', '.join(sides)}")
    print(f"{'precision':<10}{'mode':<9}{'side':<12}{'ms/step':>9}{'ratio':>8}{'MFU':>7}"
          f"{'peak GiB':>10}{'graphs/breaks':>15}")
    for precision in precisions:
        modes = ((True,) if args.only_compiled else (False, True)) if args.compile else (False,)
        for compiled in modes:
            ours = ("hand", "hand_again", "accel_ctx")  # the peers: eager bf16/fp16 only
            runnable = [s for s in sides if s in ours or not (compiled or precision == "fp8")]
            results: dict[str, list[dict[str, Any]]] = {s: [] for s in runnable}
            for r in range(args.rounds):
                order = runnable[r % len(runnable):] + runnable[:r % len(runnable)]
                for side in order:
                    results[side].append(_run(side, args, compiled, precision))
            for side in runnable:
                runs = results[side]
                ratio = _geomean([a["ms"] / h["ms"] for a, h in zip(runs, results["hand"],
                                                                      strict=True)])
                ms = statistics.median(x["ms"] for x in runs)
                flops = 6 * runs[0]["params"] * statistics.median(x["tokens_per_s"] for x in runs)
                mfu = flops / (args.peak_tflops * 1e12)
                peak = max(x["peak"] for x in runs) / 2**30
                label = "A/A floor" if side == "hand_again" else side
                graphs = f"{runs[0]['graphs']}/{runs[0]['breaks']}" if compiled else "-"
                print(f"{precision:<10}{'compiled' if compiled else 'eager':<9}{label:<12}"
                      f"{ms:>9.2f}{ratio:>8.3f}{mfu:>7.1%}{peak:>10.2f}{graphs:>15}")


if __name__ == "__main__":
    main()
