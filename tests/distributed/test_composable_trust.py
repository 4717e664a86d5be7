"""A module under torch's composable replicate()/fully_shard() gets no second engine (point 17).

accel_ctx reads torch's own registry of composable APIs: the module keeps torch's engine, is
not adopted (no DistributedDataParallel of ours on top), and trains to the same weights as one
process with the whole batch.
"""

from __future__ import annotations

import torch

from .._spawn import spawn
from ..workers import composable_trust
from ..workers.common import params, train

BATCH = 8


def test_replicated_and_fully_sharded_modules_keep_torchs_engine_only(tmp_path):
    per_rank = spawn(composable_trust.run, 2, tmp_path, ["replicate", "fully_shard"], timeout=180)
    reference = params(train("mlp", BATCH * 2, epochs=1))
    for rank, results in enumerate(per_rank):
        for apply in ("replicate", "fully_shard"):
            result = results[apply]
            where = f"rank {rank}, {apply}"
            assert result["world"] == 2, where
            assert set(result["engines"]) == {None}, (where, result["engines"])  # never adopted
            assert result["class"].startswith("DDP" if apply == "replicate" else "FSDP"), where
            for key, value in reference.items():
                torch.testing.assert_close(result["weights"][key], value, rtol=1e-5, atol=1e-6,
                                           msg=f"{where}: {key}")
        part = results["part"]
        assert part == {"apis": ["replicate"], "record": False, "grad": True}, (rank, part)
