from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.optim import optimizer as optim_module
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from accel_ctx._hooks import patches as _patches
from accel_ctx._kernel import state as _state

from . import _cpu, _durations, _fast, _timeouts

torch.set_num_threads(1)

# The stock entry points, read before any scope opened.
STOCK = {
    (nn.Module, "__call__"): nn.Module.__dict__["__call__"],
    (nn.Module, "__getattr__"): nn.Module.__dict__["__getattr__"],
    (nn.Module, "zero_grad"): nn.Module.__dict__["zero_grad"],
    (torch.Tensor, "backward"): torch.Tensor.__dict__["backward"],
    (DataLoader, "__iter__"): DataLoader.__dict__["__iter__"],
    (DataLoader, "__len__"): DataLoader.__dict__["__len__"],
    (DataLoader, "_index_sampler"): DataLoader.__dict__["_index_sampler"],
    (torch.optim.Optimizer, "zero_grad"): torch.optim.Optimizer.__dict__["zero_grad"],
    (torch.optim.lr_scheduler.LRScheduler, "step"): torch.optim.lr_scheduler.LRScheduler.__dict__["step"],
    (torch.nn.utils, "clip_grad_norm_"): torch.nn.utils.clip_grad_norm_,
    (DistributedSampler, "set_epoch"): DistributedSampler.__dict__["set_epoch"],
    (torch.nn.utils.clip_grad, "clip_grad_norm_"): torch.nn.utils.clip_grad.clip_grad_norm_,
    (optim_module, "chain"): optim_module.chain,
}


def assert_stock() -> None:
    for (owner, name), stock in STOCK.items():
        assert owner.__dict__[name] is stock, f"{owner.__name__}.{name} is still patched"
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # loaded by a test, or not
    if eval_frame is not None:
        call = eval_frame.OptimizedModule.__dict__["__call__"]
        assert call.__module__.startswith("torch."), "OptimizedModule.__call__ is still patched"
    assert not any(
        getattr(h, "__module__", "").startswith("accel_ctx")
        for h in optim_module._global_optimizer_pre_hooks.values()
    ), "optimizer step hook left behind"


# accel_ctx's rendezvous and probe threads (daemons) outlive a failed rendezvous inside
# TCPStore's constructor, which blocks up to its own timeout. Waited for at the test's end: what
# torch's C++ logs when that timeout fires (a stack trace) lands in the test's capture, and the
# thread is not met at the interpreter's exit, where it aborts the process ("terminate called
# without an active exception", after a passing run of the suite).
_LINGERING_THREADS = ("accel_ctx-rendezvous", "accel_ctx-probe")


def _wait_for_lingering_threads() -> None:
    deadline = time.monotonic() + _timeouts.scaled(30)
    for thread in threading.enumerate():
        if thread.name in _LINGERING_THREADS:
            thread.join(max(0.0, deadline - time.monotonic()))


@pytest.fixture(autouse=True)
def no_state_left_behind():
    env_before = dict(os.environ)
    yield
    _wait_for_lingering_threads()
    problems = []
    if _state.raw() is not None:
        problems.append("a scope frame is still on the stack")
    if _patches.installed():
        problems.append("patches are still installed")
    if dist.is_available() and dist.is_initialized():
        problems.append("a process group is still initialised")
        dist.destroy_process_group()
    changed = {
        kv for kv in set(os.environ.items()) ^ set(env_before.items())
        if not kv[0].startswith(("PYTEST_", "TORCHINDUCTOR_", "TRITON_"))  # compile's caches
    }
    if changed:
        problems.append(f"environment changed: {sorted(changed)}")
        os.environ.clear()
        os.environ.update(env_before)
    try:
        assert_stock()
    except AssertionError as exc:
        problems.append(str(exc))
    assert not problems, "; ".join(problems)


@pytest.fixture(autouse=True)
def cpu_unless_gpu_test(request, no_state_left_behind, monkeypatch):
    """Tests of CPU semantics run on the CPU also on a machine with a GPU.

    On a contributor's one-GPU workstation ``distributed()`` would otherwise pick cuda:0 in every
    test, and several spawned ranks would share that one GPU under NCCL. GPU behaviour is tested
    by the ``gpu`` tests, which see the machine as it is. Requesting ``no_state_left_behind``
    first makes monkeypatch restore the variable before that fixture checks the environment.
    """
    if "gpu" not in request.keywords:
        monkeypatch.setenv("ACCEL_CTX_DEVICE", "cpu")


@pytest.fixture(autouse=True)
def fast_tier_starts_no_process(request, monkeypatch):
    """Under --fast a test that starts a Python process fails, naming the marker it lacks."""
    if request.config.getoption("fast", False):
        _fast.guard(monkeypatch)


_TESTS = Path(__file__).resolve().parent

# The compat tier (`./dev compat VERSION`, `-m compat`): the files that drive every entry point
# accel_ctx patches (Module.__call__, DataLoader.__iter__, Tensor.backward, optimizer steps,
# OptimizedModule.__call__) and every torch-private name it reaches (_data/torch_private.py,
# Dynamo's frame skipping, FSDP2, DTensor and DCP internals, c10d's store). The examples run
# once, in ./dev test: they reach nothing those files do not (each tier used to run them again).
COMPAT = (
    "scopes/test_scopes.py",
    "scopes/test_foundation_mp.py",
    "distributed/test_fidelity.py",
    "accumulation/test_accumulate.py",
    "precision/test_precision.py",
    "compile/test_compile.py",
    "data/test_batches.py",
    "data/test_order_stream.py",
    "sharded/test_sharded.py",
    "sharded/test_sharded_touch.py",
    "tensor_parallel/test_tensor_parallel.py",
    "sequence_parallel/test_sequence_parallel.py",  # F.scaled_dot_product_attention, funcol
    "pipeline/test_pipeline.py",  # p2p on a mesh's groups, DCP's flat optimizer keys
    "checkpoints/test_checkpoint.py",
    "checkpoints/test_sharded_checkpoint.py",
    "resumable/test_resumable_matching.py",
    "package/test_quiet.py",
)


def pytest_configure(config):
    config.addinivalue_line("markers", f"{_fast.MARKER}: starts processes; not in the fast tier "
                            "(found at collection by tests/_fast.py, or marked by hand)")
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order made below
        config.option.loadscopereorder = False
    if config.getoption("record_durations", False) and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_durations.Recorder(config.rootpath), "accel_ctx-durations")
    _cpu.configure(config)


def _dispatch_order(items: list[pytest.Item], root: Path) -> list[pytest.Item]:
    """The files longest first, as the suite recorded them (tests/_durations.py), new ones
    before all; each file's tests stay together, in their order."""
    files: dict[Path, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(Path(item.path), []).append(item)
    ordered = _durations.order({path: len(tests) for path, tests in files.items()}, root,
                               _durations.load())
    return [item for path in ordered for item in files[path]]


def pytest_itemcollected(item):  # before `-m` selects
    path = Path(item.path)
    if _TESTS in path.parents and path.relative_to(_TESTS).as_posix() in COMPAT:
        item.add_marker(pytest.mark.compat)
    if _fast.starts_processes(item):
        item.add_marker(_fast.MARKER)


@pytest.hookimpl(trylast=True)  # after pytest's own grouping by fixture
def pytest_collection_modifyitems(config, items):
    if config.getoption("fast", False):  # the fast tier: what starts no process
        config.hook.pytest_deselected(items=[i for i in items if _fast.MARKER in i.keywords])
        items[:] = [i for i in items if _fast.MARKER not in i.keywords]
    items[:] = _dispatch_order(items, config.rootpath)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (NCCL, CUDA autocast); none here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class TimedOut(AssertionError):
    """A subprocess outlived its (scaled) timeout; the message says how loaded the machine was."""


def _timed_out(exc: subprocess.TimeoutExpired) -> TimedOut:
    return TimedOut(f"{exc}\n{_timeouts.hint()}")


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    try:
        return (yield)
    except subprocess.TimeoutExpired as exc:
        raise _timed_out(exc) from exc


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    try:
        return (yield)
    except subprocess.TimeoutExpired as exc:
        raise _timed_out(exc) from exc
