"""Ring attention (issue 56): ``cp=N`` routes attention to torch's ``context_parallel`` kernels,
which exist on CUDA only; on CPU it is refused at the option, naming ``sp=``. The GPU tests need
2 GPUs (one rank per GPU) and are skipped elsewhere."""

from __future__ import annotations

import pytest
import torch

from accel_ctx import distributed, sharded
from accel_ctx.errors import ConfigurationError

from .._spawn import spawn
from ..workers import sequence_parallel as w


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal: this machine has CUDA")
def test_cp_on_cpu_is_refused_naming_sp():
    with pytest.raises(ConfigurationError, match=r"distributed\(cp=2\): ring attention .* CUDA "
                       r"kernels only, and this job runs on cpu\. Use sp=2"):
        distributed(cp=2)


def test_cp_on_a_cpu_device_is_refused_even_with_cuda():
    with pytest.raises(ConfigurationError, match=r"sharded\(cp=2\).*Use sp=2"):
        sharded(cp=2, device="cpu")


def test_sp_and_cp_together_are_refused():
    with pytest.raises(ConfigurationError, match=r"sp=2, cp=2\): give one"):
        distributed(sp=2, cp=2, device="cuda")


def test_cp_with_tp_is_refused():
    with pytest.raises(ConfigurationError, match=r"cp=2, tp=2\): sequence and tensor"):
        sharded(cp=2, tp=2)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="ring attention needs 2 GPUs: one rank per GPU (NCCL), and torch's "
                           "context_parallel has no CPU kernels")
def test_ring_and_ulysses_on_two_gpus_train_like_one_process(tmp_path):
    want = w.train("one", 4, epochs=1)  # on the CPU: the GPU's kernels round differently
    for rank, result in enumerate(spawn(w.gpu_two_ranks, 2, tmp_path, timeout=600)):
        for kind in ("cp", "sp"):
            got = result[kind]
            assert got["where"] == {"dp": 1, "sp": 2, "sp_rank": rank}, kind
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]),
                                       rtol=1e-3, atol=1e-3)
            for key, value in want["weights"].items():
                torch.testing.assert_close(got["weights"][key].cpu(), value, rtol=1e-3,
                                           atol=1e-3, msg=lambda m, k=key, c=kind: f"{c} {k}: {m}")
