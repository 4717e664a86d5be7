"""What a person watches: a rank-0 progress bar over any iterable, and ``log_metrics``.

Both act on the main process only (decided when called, not when imported) and need nothing
beyond torch: the bar is ``tqdm`` when it is installed (the bar people already know), else a
plain line every few seconds; metrics always go to a CSV file, and also to TensorBoard when
``torch.utils.tensorboard`` imports, to W&B when a ``wandb`` run is active and to MLflow when an
``mlflow`` run is active.
"""

from __future__ import annotations

import csv
import importlib
import numbers
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from .._kernel import state as _state
from .._options import checked, file_path, positive, text, unknown_option, whole
from .._warn import warn_user
from ..errors import ConfigurationError

T = TypeVar("T")
METRICS_DIR_VAR = "ACCEL_CTX_METRICS_DIR"
_DEFAULT_DIR = "runs/accel_ctx"


class _Writers:
    """log_metrics(): one writer per tracker and directory for the life of the process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._writers: dict[tuple[str, str], Any] = {}

    def get(self, key: tuple[str, str], make: Callable[[], Any]) -> Any:
        """The writer cached under ``key`` (tracker, directory), made on first use."""
        with self._lock:
            writer = self._writers.get(key)
            if writer is None:
                writer = self._writers[key] = make()
        _state.close_at_exit(self.close)
        return writer

    def folders(self) -> list[str]:
        """The folders the cached writers write into (TensorBoard's events stay open)."""
        with self._lock:
            return [folder for _, folder in self._writers]

    def close(self) -> None:
        """Close every cached writer (log_metrics flushes after each call; this frees them)."""
        with self._lock:
            writers = list(self._writers.values())
            self._writers.clear()
        for writer in writers:
            close = getattr(writer, "close", None)
            if callable(close):
                close()

    def forget(self) -> None:
        """In a forked child: the parent's writers are the parent's to flush and close (kept
        referenced, never finalised here: a writer's destructor would flush into its files)."""
        self._lock = threading.Lock()
        _state.leave_to_the_parent(self._writers)
        self._writers = {}


_writers = _Writers()
_state.reset_after_fork(_writers.forget)


def metrics_folders() -> list[str]:
    """Where log_metrics keeps files open for writing (an evaluation's verdict, _data.eval_passes,
    does not count their growth as the loop's results)."""
    return _writers.folders()


def _optional(name: str) -> Any | None:
    try:
        return importlib.import_module(name)
    except Exception:  # absent, or broken in this environment: the tracker is skipped
        return None


@checked
def progress(iterable: Iterable[T], desc: str | None = None, total: int | None = None,
             *, every_s: float = 10.0, **tqdm_options: Any) -> Iterator[T]:
    """Yield ``iterable``'s items on every rank; draw a progress bar on the main process only.

    The bar is ``tqdm`` when installed (``tqdm_options`` go to it); without tqdm, rank 0 prints
    ``desc: i/total`` to stderr at most once every ``every_s`` seconds and at the end. ``total``
    defaults to ``len(iterable)`` where it has one: inside a scope, a DataLoader's length is
    this rank's share of batches, which is what the loop runs through.

    Examples:
        >>> from accel_ctx import progress
        >>> sum(progress(range(5), desc="demo", disable=True))
        10
    """
    if not hasattr(iterable, "__iter__") and not hasattr(iterable, "__getitem__"):
        raise ConfigurationError(
            f"progress({_short(iterable)}): give something to loop over (a DataLoader, a range, "
            f"a list), not a {type(iterable).__name__}.")
    text("progress", "desc", desc)
    if total is not None:
        whole("progress", "total", total, 0, "give the number of items, an int >= 0, or None.")
    positive("progress", "every_s", every_s, "give the seconds between lines, a number >= 0.",
             zero=True)
    for name in tqdm_options:
        if name not in _TQDM_OPTIONS:
            raise unknown_option("progress", name, ("iterable", "desc", "total", "every_s",
                                                    *_TQDM_OPTIONS))
    return _progress(iterable, desc, total, every_s, tqdm_options)


# tqdm's own options (tqdm.tqdm.__init__), passed through: checked on every rank, not only on
# the rank that draws the bar, and also where tqdm is not installed
_TQDM_OPTIONS = ("leave", "file", "ncols", "mininterval", "maxinterval", "miniters", "ascii",
                 "disable", "unit", "unit_scale", "dynamic_ncols", "smoothing", "bar_format",
                 "initial", "position", "postfix", "unit_divisor", "write_bytes", "lock_args",
                 "nrows", "colour", "delay", "gui")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _progress(iterable: Iterable[T], desc: str | None, total: int | None, every_s: float,
              tqdm_options: dict[str, Any]) -> Iterator[T]:
    if total is None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    if _state.coordinates().rank != 0:
        yield from iterable
        return
    tqdm = _optional("tqdm.auto")
    if tqdm is not None:
        yield from tqdm.tqdm(iterable, desc=desc, total=total, **tqdm_options)
        return
    if tqdm_options.get("disable"):
        yield from iterable
        return
    label = f"{desc}: " if desc else ""
    last = time.monotonic()
    count = 0
    for count, item in enumerate(iterable, 1):
        yield item
        now = time.monotonic()
        if now - last >= every_s:
            last = now
            print(f"{label}{count}/{total if total is not None else '?'}", file=sys.stderr,
                  flush=True)
    print(f"{label}{count}/{total if total is not None else count} done", file=sys.stderr,
          flush=True)


def _number(name: str, value: Any) -> float | None:
    if hasattr(value, "item") and callable(value.item):  # a one-element tensor or array
        try:
            value = value.item()
        except (ValueError, RuntimeError):
            return None
    if isinstance(value, numbers.Real):
        return float(value)
    return None


@checked
def log_metrics(metrics: Mapping[str, Any], step: int | None = None, *,
                directory: str | os.PathLike[str] | None = None) -> None:
    """Record ``metrics`` (name -> number) at ``step`` on the main process, with every tracker
    installed.

    Always appended to ``<directory>/metrics.csv`` (columns ``step, name, value, time``);
    also written to TensorBoard (``SummaryWriter(<directory>)``) when ``tensorboard`` is
    installed, to W&B when ``wandb.run`` is active and to MLflow when an ``mlflow`` run is
    active. ``directory`` defaults to ``$ACCEL_CTX_METRICS_DIR``, else ``runs/accel_ctx``.
    Tensors and NumPy scalars are read with ``.item()``; values that are not numbers are
    skipped with a warning. ``step`` defaults to ``state().step``. Other ranks do nothing, so
    every rank may call it (reduce the values first to log the job's mean).

    Examples:
        >>> import tempfile
        >>> from accel_ctx import log_metrics
        >>> folder = tempfile.mkdtemp()
        >>> log_metrics({"loss": 0.5}, step=1, directory=folder)
        >>> row = open(f"{folder}/metrics.csv").read().splitlines()[1]
        >>> row.rsplit(",", 1)[0]
        '1,loss,0.5'
    """
    if not isinstance(metrics, Mapping):
        raise ConfigurationError(
            f"log_metrics() takes a dict of name -> number, got {type(metrics).__name__}.")
    if step is not None:  # checked on every rank, before anything is written
        step = whole("log_metrics", "step", step, 0,
                     "give the step, an int >= 0, or None for state().step.")
    if directory is not None:
        file_path("log_metrics", "directory", directory)
    if _state.coordinates().rank != 0:
        return
    if step is None:
        stack = _state.current()
        step = stack.session.step if stack is not None else 0
    values: dict[str, float] = {}
    skipped = []
    for name, value in metrics.items():
        number = _number(str(name), value)
        if number is None:
            skipped.append(str(name))
        else:
            values[str(name)] = number
    if skipped:
        warn_user(f"log_metrics() skipped {skipped}: only numbers (and one-element tensors) "
                  "are logged.")
    named = (f"log_metrics(directory={os.fspath(directory)!r})" if directory is not None
             else f"log_metrics() (${METRICS_DIR_VAR})" if os.environ.get(METRICS_DIR_VAR)
             else "log_metrics() (its default folder)")
    folder = Path(directory if directory is not None
                  else os.environ.get(METRICS_DIR_VAR) or _DEFAULT_DIR)
    _to_csv(folder, values, step, named)
    _to_tensorboard(folder, values, step)
    _to_wandb(values, step)
    _to_mlflow(values, step)


def _to_csv(folder: Path, values: dict[str, float], step: int, named: str) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # the folder, or a folder above it, is a file
        file = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()),
                    folder)
        raise ConfigurationError(
            f"{named}: {str(file)!r} is a file, not a folder. log_metrics writes metrics.csv "
            "(and TensorBoard's events) into the folder it is given: give a folder (new or "
            f"existing), e.g. directory={str(file.parent)!r} writes "
            f"{str(file.parent / 'metrics.csv')!r}.") from None
    path = folder / "metrics.csv"
    new = not path.exists()
    now = time.time()
    with path.open("a", newline="") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow(["step", "name", "value", "time"])
        for name, value in values.items():
            writer.writerow([step, name, value, f"{now:.3f}"])


def _to_tensorboard(folder: Path, values: dict[str, float], step: int) -> None:
    if _optional("tensorboard") is None:
        return
    board = _optional("torch.utils.tensorboard")
    if board is None:
        return
    writer = _writers.get(("tensorboard", str(folder.resolve())),
                                  lambda: board.SummaryWriter(str(folder)))
    for name, value in values.items():
        writer.add_scalar(name, value, step)
    writer.flush()


def _to_wandb(values: dict[str, float], step: int) -> None:
    wandb = sys.modules.get("wandb")  # only a run the user started: never import it here
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.log(values, step=step)


def _to_mlflow(values: dict[str, float], step: int) -> None:
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None and mlflow.active_run() is not None:
        mlflow.log_metrics(values, step=step)
