"""The measuring method shared by the benchmarks (see DESIGN.md, "How to measure here").

Whole runs vary 10-20 % from one process to the next and the second run of a back-to-back pair
is faster than the first, so every comparison here is made of *pairs* run in one go:

* the two sides of a pair alternate their order (A B, B A, A B, ...), which cancels the
  second-run advantage;
* each pair gives a ratio (B / A); the result is the geometric mean of those ratios, with a
  95 % confidence interval from their spread;
* the same procedure run with the hand-written side twice (A / A') gives the noise floor, which
  is printed beside every ratio: a B / A ratio inside the A / A spread is not a measured cost;
* wall time and process CPU time are both recorded per unit of work (a step, a forward).

``A`` is always the reference (stock PyTorch, written by hand), ``B`` accel_ctx and ``A2`` the
reference again, run as if it were a second contender.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

REF, ACCEL, REF2 = "A", "B", "A2"

# The entry points accel_ctx patches while a scope is open, as stock PyTorch has them (captured
# by the first assert_stock(), before any scope opens): the reference side checks it runs on them.
_STOCK: dict[str, object] = {}


def _stock_entry_points() -> dict[str, object]:
    import torch
    from torch.utils.data import DataLoader

    return {
        "nn.Module.__call__": torch.nn.Module.__dict__["__call__"],
        "Tensor.backward": torch.Tensor.__dict__["backward"],
        "DataLoader.__iter__": DataLoader.__dict__["__iter__"],
        "Optimizer.zero_grad": torch.optim.Optimizer.__dict__["zero_grad"],
    }


def assert_stock() -> None:
    """Fail if a patch of accel_ctx is still installed (the reference would not be stock)."""
    if not _STOCK:
        _STOCK.update(_stock_entry_points())
    now = _stock_entry_points()
    patched = [name for name, fn in _STOCK.items() if now[name] is not fn]
    if patched:
        raise AssertionError(f"not stock PyTorch outside the scopes: {', '.join(patched)}")


@dataclass(frozen=True)
class Block:
    """One timed run of one side; ``kind`` is ``"AB"`` (reference vs accel_ctx) or ``"AA"``."""

    pair: int
    kind: str
    side: str


def plan(pairs: int) -> list[Block]:
    """The order of the timed blocks: ``pairs`` A/B pairs and as many A/A pairs, interleaved.

    Pair ``i`` runs its two sides in the order A, B for even ``i`` and B, A for odd ``i`` (the
    A/A pairs likewise with A, A2); even pairs put the A/B pair first, odd pairs the A/A pair,
    so no side keeps a fixed position in the sequence.
    """
    blocks: list[Block] = []
    for i in range(pairs):
        ab = [Block(i, "AB", REF), Block(i, "AB", ACCEL)]
        aa = [Block(i, "AA", REF), Block(i, "AA", REF2)]
        if i % 2:
            ab.reverse()
            aa.reverse()
        blocks += ab + aa if i % 2 == 0 else aa + ab
    return blocks


@dataclass(frozen=True)
class Sample:
    """Seconds per unit of work: wall-clock and CPU time of the process (all its threads)."""

    wall: float
    cpu: float


class Timer:
    """``with Timer() as t: ...`` then ``t.sample(units)``: wall and process CPU per unit."""

    def __enter__(self) -> Timer:
        self.cpu0 = time.process_time()
        self.wall0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall1 = time.perf_counter()
        self.cpu1 = time.process_time()

    @property
    def wall(self) -> float:
        return self.wall1 - self.wall0

    @property
    def cpu(self) -> float:
        return self.cpu1 - self.cpu0

    def sample(self, units: int) -> Sample:
        return Sample(self.wall / units, self.cpu / units)


# Two-sided 95 % quantiles of Student's t for n - 1 degrees of freedom (n = pairs).
_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26,
        10: 2.23, 12: 2.18, 15: 2.13, 20: 2.09, 30: 2.04}


def _t95(dof: int) -> float:
    if dof <= 0:
        return math.inf
    known = [d for d in _T95 if d <= dof]
    return _T95[max(known)] if dof <= 30 else 1.96


@dataclass(frozen=True)
class Ratio:
    """Geometric mean of per-pair ratios with its 95 % confidence interval."""

    geomean: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, numerators: Sequence[float], denominators: Sequence[float]) -> Ratio:
        logs = [math.log(a / b) for a, b in zip(numerators, denominators, strict=True)]
        mean = statistics.fmean(logs)
        half = _t95(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else math.inf
        return cls(math.exp(mean), math.exp(mean - half), math.exp(mean + half), len(logs))

    def __str__(self) -> str:
        if math.isinf(self.high):
            return f"{self.geomean:.3f}"
        return f"{self.geomean:.3f} [{self.low:.3f}-{self.high:.3f}]"


@dataclass
class Comparison:
    """All samples of one row: reference, accel_ctx, and the reference's A/A pairs."""

    name: str
    samples: dict[tuple[str, str], dict[int, Sample]] = field(default_factory=dict)

    def add(self, block: Block, sample: Sample) -> None:
        self.samples.setdefault((block.kind, block.side), {})[block.pair] = sample

    def _pairs(self, kind: str, first: str, second: str) -> tuple[list[Sample], list[Sample]]:
        a, b = self.samples.get((kind, first), {}), self.samples.get((kind, second), {})
        common = sorted(set(a) & set(b))
        return [a[i] for i in common], [b[i] for i in common]

    def ratio(self, metric: str, kind: str = "AB") -> Ratio:
        """``metric`` is ``"wall"`` or ``"cpu"``; ``kind`` ``"AB"`` (B / A) or ``"AA"`` (A2 / A)."""
        a, b = self._pairs(kind, REF, ACCEL if kind == "AB" else REF2)
        return Ratio.of([getattr(s, metric) for s in b], [getattr(s, metric) for s in a])

    def median(self, side: str, metric: str) -> float:
        """Median seconds per unit of one side over all its A/B-pair blocks."""
        values = [getattr(s, metric) for s in self.samples.get(("AB", side), {}).values()]
        return statistics.median(values)


def run_plan(
    blocks: Iterable[Block], run_block: Callable[[Block], Sample], name: str
) -> Comparison:
    """Run ``run_block`` for every block in order (one process) and collect the samples."""
    result = Comparison(name)
    for block in blocks:
        result.add(block, run_block(block))
    return result


def calibrate(seconds_per_unit: float, target_seconds: float, lo: int, hi: int) -> int:
    """How many units of work make one timed block of about ``target_seconds``."""
    if seconds_per_unit <= 0:
        return hi
    return max(lo, min(hi, math.ceil(target_seconds / seconds_per_unit)))


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}" if seconds < 0.1 else f"{seconds * 1e3:.1f}"


def verdict(ratio: Ratio, floor: Ratio, target: float) -> str:
    """``ok`` at or under target; ``OVER`` when the whole interval lies above it; ``over?``
    when only the mean does. ``(noisy)`` marks a row whose A/A floor spreads wider than the
    budget: that run cannot resolve the budget; rerun it on a quiet machine or with more pairs.
    """
    word = "ok" if ratio.geomean <= target else "OVER" if ratio.low > target else "over?"
    noisy = floor.high > target or floor.low < 1 / target
    return f"{word} (noisy)" if noisy else word


def table(rows: Sequence[Comparison], unit: str, target: float) -> str:
    """A readable table: per-unit times of both sides, ratios and their A/A floors."""
    header = (
        f"{'row':<22} {'hand wall':>10} {'accel wall':>10} {'hand cpu':>9} {'accel cpu':>9}"
        f"  {'ratio wall [95% CI]':<22} {'A/A wall (floor)':<22}"
        f"  {'ratio cpu [95% CI]':<22} {'A/A cpu (floor)':<22} {'n':>3}  verdict"
    )
    lines = [f"times in ms per {unit} (medians); ratios = accel_ctx / hand-written, "
             f"geometric mean of per-pair ratios; target <= {target:.2f}", header,
             "-" * len(header)]
    for row in rows:
        wall, cpu = row.ratio("wall"), row.ratio("cpu")
        wall_aa, cpu_aa = row.ratio("wall", "AA"), row.ratio("cpu", "AA")
        lines.append(
            f"{row.name:<22} {_ms(row.median(REF, 'wall')):>10} {_ms(row.median(ACCEL, 'wall')):>10}"
            f" {_ms(row.median(REF, 'cpu')):>9} {_ms(row.median(ACCEL, 'cpu')):>9}"
            f"  {wall!s:<22} {wall_aa!s:<22}  {cpu!s:<22} {cpu_aa!s:<22} {wall.n:>3}"
            f"  {verdict(wall, wall_aa, target)}"
        )
    return "\n".join(lines)
