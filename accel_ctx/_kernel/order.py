"""Where each concern runs among the open ones (lower first), in one table.

The order is the layout's order (torchtitan's ``parallelize_llama`` applies its steps in one
order too): fp8 converts a model's layers before the engine wraps it; the engine adopts a model
before ``resumable()`` restores into it; accumulation decides which micro-batch steps before
the precision's loss scaling unscales; ``local_sgd()`` sees only the steps accumulation lets by,
and the replica groups only the steps that are taken.

>>> ORDER["distributed"] < ORDER["accumulate"] < ORDER["replica_groups"]
True
"""

from __future__ import annotations

ORDER: dict[str, int] = {
    "fp8": -10,  # mixed_precision("fp8"): Linear layers converted before DDP or FSDP2 wraps them
    "distributed": 0,  # the engine: DDP, FSDP2, tensor parallelism
    "sequence": 2,  # sp=: positions and labels of the slices before resumable() sees a call
    "resume": 5,  # resumable(): after the engine adopted a model, before accumulation
    "accumulate": 10,
    "sync": 20,  # no_sync()
    "precision": 30,
    "local_sgd": 40,  # after accumulate(): it sees only the steps a group lets by
    "replica_groups": 50,  # after accumulate and local_sgd: only the steps that are taken
}
