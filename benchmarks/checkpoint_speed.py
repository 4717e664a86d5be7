"""Checkpoint speed: ``save_state``/``load_state`` vs ``torch.save``/``torch.load`` and vs DCP.

One process, a 100M-parameter model (ten ``Linear(3162, 3162)``, 400 MB in fp32), its weights
only. Every timed block is one save or one load; the sides alternate in the order of
``_measure.plan`` and every ratio comes with its A/A noise floor. Rows (A = reference, B =
accel_ctx):

======================  ===============================================  =====================
row                     A                                                B
======================  ===============================================  =====================
save / torch.save       ``torch.save(model.state_dict(), f)``            ``save_state(d, model=model)``
save / torch.save+sync  the same, then ``fsync`` and ``os.replace``:     ``save_state``
                        the durability ``save_state`` gives
save / dcp.save         ``dcp.save(get_model_state_dict(model), d)``     ``save_state``
load / torch.load       ``model.load_state_dict(torch.load(f,            ``load_state(d, model=model)``
                        weights_only=True))``
load / dcp.load         ``dcp.load`` into ``get_model_state_dict``,      ``load_state``
                        then ``set_model_state_dict``
save / no checksums     ``save_state`` with the CRC-32 of every file     ``save_state``
                        switched off (the cost of recording them)
load / no checksums     ``load_state`` without verifying the files       ``load_state``
                        against their CRC-32 (the cost of verifying)
======================  ===============================================  =====================

Every save writes new files; the previous output is removed outside the timed block (so
``save_state`` runs with ``keep_last=None``: rotation is a rename and a delete). Loads read
files written just before, from the page cache, on every side alike.

    python benchmarks/checkpoint_speed.py            # 5 pairs per row, about 4 minutes
    python benchmarks/checkpoint_speed.py --quick    # 2 pairs per row, about 2 minutes
    python benchmarks/checkpoint_speed.py --only checksums   # just the two checksum rows
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import contextlib
import gc
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from _measure import ACCEL, Block, Comparison, Sample, Timer, plan, run_plan, table
from torch import nn
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    set_model_state_dict,
)

from accel_ctx import load_state, save_state
from accel_ctx._checkpoint import find, sums

TARGET = 1.10


@contextlib.contextmanager
def checksums_off() -> Iterator[None]:
    """save_state records no CRC-32 (zeros instead) and load_state verifies none."""
    crc, verify = sums._crc32, find.mismatches
    sums._crc32 = lambda data, value=0: 0
    find.mismatches = lambda *args: None
    try:
        yield
    finally:
        sums._crc32, find.mismatches = crc, verify


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(3162, 3162) for _ in range(10)])


class Sides:
    """The operations compared, each writing into (or reading from) its own folder."""

    def __init__(self, model: nn.Module, root: Path) -> None:
        self.model, self.root = model, root
        self.count = 0

    def fresh(self, name: str) -> Path:
        """A new output path; the previous outputs are deleted first (untimed)."""
        for old in self.root.glob("out-*"):
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        self.count += 1
        return self.root / f"out-{self.count}-{name}"

    # ---- saves ----
    def torch_save(self, path: Path) -> None:
        torch.save(self.model.state_dict(), path)

    def torch_save_synced(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            torch.save(self.model.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(path.parent, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    def dcp_save(self, path: Path) -> None:
        state_dict_saver.save(get_model_state_dict(self.model), checkpoint_id=path, no_dist=True)

    def accel_save(self, path: Path) -> None:
        save_state(path, keep_last=None, model=self.model)

    def accel_save_unchecked(self, path: Path) -> None:
        with checksums_off():
            self.accel_save(path)

    # ---- loads (from files written by prepare_loads) ----
    def prepare_loads(self) -> None:
        self.torch_file = self.root / "load.pt"
        self.torch_save(self.torch_file)
        self.dcp_dir = self.root / "load-dcp"
        self.dcp_save(self.dcp_dir)
        self.accel_dir = self.root / "load-accel"
        self.accel_save(self.accel_dir)

    def torch_load(self) -> None:
        self.model.load_state_dict(torch.load(self.torch_file, weights_only=True))

    def dcp_load(self) -> None:
        state = get_model_state_dict(self.model)
        state_dict_loader.load(state, checkpoint_id=self.dcp_dir, no_dist=True)
        set_model_state_dict(self.model, state)

    def accel_load(self) -> None:
        assert load_state(self.accel_dir, model=self.model)

    def accel_load_unverified(self) -> None:
        with checksums_off():
            self.accel_load()


def save_row(sides: Sides, name: str, reference: Callable[[Path], None], pairs: int) -> Comparison:
    def block(b: Block) -> Sample:
        op = sides.accel_save if b.side == ACCEL else reference
        path = sides.fresh(b.side)
        gc.collect()
        with Timer() as timer:
            op(path)
        return timer.sample(1)

    return run_plan(plan(pairs), block, name)


def load_row(sides: Sides, name: str, reference: Callable[[], None], pairs: int) -> Comparison:
    def block(b: Block) -> Sample:
        op = sides.accel_load if b.side == ACCEL else reference
        gc.collect()
        with Timer() as timer:
            op()
        return timer.sample(1)

    return run_plan(plan(pairs), block, name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=5, help="A/B pairs per row (and A/A)")
    parser.add_argument("--quick", action="store_true", help="2 pairs per row")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    parser.add_argument("--only", default=None, help="run only the rows whose name has this")
    args = parser.parse_args(argv)
    pairs = 2 if args.quick else args.pairs
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # DCP's "saving in a single process" notice
    model = make_model()
    params = sum(p.numel() for p in model.parameters())
    root = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    try:
        sides = Sides(model, root)
        sides.accel_save(sides.fresh("warmup"))  # imports, first-call costs
        sides.prepare_loads()
        saves = {"save / torch.save": sides.torch_save,
                 "save / torch.save+sync": sides.torch_save_synced,
                 "save / dcp.save": sides.dcp_save,
                 "save / no checksums": sides.accel_save_unchecked}
        loads = {"load / torch.load": sides.torch_load, "load / dcp.load": sides.dcp_load,
                 "load / no checksums": sides.accel_load_unverified}
        wanted = [n for n in [*saves, *loads] if args.only is None or args.only in n]
        rows = [save_row(sides, n, saves[n], pairs) if n in saves
                else load_row(sides, n, loads[n], pairs) for n in wanted]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"model: {params / 1e6:.1f}M parameters ({params * 4 / 2**20:.0f} MiB fp32), "
          f"one process, {torch.get_num_threads()} thread; A = reference, B = accel_ctx")
    text = table(rows, "save or load", TARGET)
    print(text.replace("hand-written", "reference").replace("hand wall", " ref wall")
          .replace("hand cpu", " ref cpu"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
