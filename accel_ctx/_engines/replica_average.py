"""The replica groups' gradient average, started as the backward makes the gradients.

Plain DDP averages each bucket of gradients as soon as the backward has made all of them, so
that the all-reduce runs beside the rest of the backward and the gradients are averaged when
``loss.backward()`` returns (clipping and the user's reads see the average). A replica group
of one rank has no DDP engine: :class:`BackwardAverage` does the same over the groups. The
buckets are DDP's own assignment (c10d's ``_compute_bucket_assignment_by_size``, DDP's cap, in
DDP's order), without DDP's small first bucket: a call through torchft's Python process group
costs far more CPU than one of DDP's C++ reducer (~0.6 ms of the main thread here, its
all-reduce and its wait). Each bucket's all-reduce is started from the gradients'
post-accumulate hooks through torchft's ``Manager.allreduce``, in bucket order (every group
issues its collectives in the same order), and waited for at the backward's end.

A backward that made a gradient twice (a reentrant checkpoint) spoils the buckets already
started: they are waited for and thrown away, and the caller averages again at the end, as
every group runs the same graph and does the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .buckets import reduce_in_buckets

_BUCKET_MB = 25  # DDP's default cap


class BackwardAverage:
    """One group's buckets over its models' parameters, and the all-reduces a backward starts.

    ``reduce(flat)`` starts the average of a flat buffer in place over the groups and returns
    what to ``wait()`` on.

    Examples:
        >>> w = nn.Parameter(torch.ones(2))
        >>> average = BackwardAverage(lambda flat: torch.futures.Future())
        >>> average.arm([w]); average.armed
        True
        >>> average.close()
    """

    def __init__(self, reduce: Callable[[torch.Tensor], Any], bucket_cap_mb: float | None = None
                 ) -> None:
        self._reduce = reduce
        self._cap = int((bucket_cap_mb or _BUCKET_MB) * 1024 * 1024)
        self._params: list[nn.Parameter] = []
        self._buckets: list[list[nn.Parameter]] = []
        self._bucket_of: dict[int, int] = {}  # id(param) -> its bucket
        self._hooks: dict[int, Any] = {}  # id(param) -> the handle of its hook
        self._waiting: list[int] = []  # per bucket: gradients not made yet in this backward
        self._made: set[int] = set()  # ids of the parameters made in this backward
        self._started: list[tuple[list[torch.Tensor], torch.Tensor, Any]] = []
        self._next = 0  # the next bucket to start (in order)
        self.armed = False
        self._spoiled = False

    def arm(self, params: list[nn.Parameter]) -> None:
        """Before a backward whose gradients are averaged: plan the buckets again where the
        parameters changed, and start counting."""
        if [id(p) for p in params] != [id(p) for p in self._params]:
            self._plan(params)
        self._waiting = [len(bucket) for bucket in self._buckets]
        self._made.clear()
        self._started.clear()
        self._next, self._spoiled, self.armed = 0, False, True

    def _plan(self, params: list[nn.Parameter]) -> None:
        self.close()
        self._params = list(params)
        if params:
            # DDP's call: the parameters in model order, then the buckets reversed (in the
            # order the backward makes their gradients)
            indices, _ = torch._C._distributed_c10d._compute_bucket_assignment_by_size(
                list(params), [self._cap])
        else:
            indices = []
        self._buckets = [[params[i] for i in bucket] for bucket in reversed(indices)]
        self._bucket_of = {id(p): b for b, bucket in enumerate(self._buckets) for p in bucket}
        for p in params:
            self._hooks[id(p)] = p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                self._made_one)

    def _made_one(self, param: torch.Tensor) -> None:
        if not self.armed:
            return
        if id(param) in self._made:
            self._spoiled = True  # made again after its bucket may have started
            return
        self._made.add(id(param))
        bucket = self._bucket_of[id(param)]
        self._waiting[bucket] -= 1
        while self._next < len(self._buckets) and self._waiting[self._next] == 0:
            self._start(self._next)

    @torch.no_grad()
    def _start(self, bucket: int) -> None:
        self._next = bucket + 1
        grads = [p.grad for p in self._buckets[bucket] if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.detach().reshape(-1) for g in grads])
        self._started.append((grads, flat, self._reduce(flat)))

    @torch.no_grad()
    def finish(self) -> bool:
        """After the backward: start the buckets left (gradients it did not make), wait for
        every one and write the averages into the gradients. False: spoiled (nothing written:
        the caller averages the gradients itself)."""
        if not self.armed:
            return False
        while self._next < len(self._buckets):
            self._start(self._next)
        started = self._drain()
        if self._spoiled:
            return False
        for grads, flat, _ in started:
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        return True

    def abandon(self) -> None:
        """The backward failed: wait for what it started (its buffers are in flight), keep
        nothing."""
        self._drain()

    def _drain(self) -> list[tuple[list[torch.Tensor], torch.Tensor, Any]]:
        """Disarm, and wait for every all-reduce started: what they were."""
        self.armed = False
        started, self._started = self._started, []
        for _, _, work in started:
            work.wait()
        return started

    def close(self) -> None:
        """Remove the hooks (the scope ends, or the parameters changed)."""
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
        self.armed = False


def average_now(tensors: list[torch.Tensor], reduce: Callable[[torch.Tensor], Any]) -> None:
    """The gradients averaged at once (a sharded model's shards, a group's DDP-averaged
    gradients, a spoiled backward): one all-reduce per device and dtype, waited for."""
    reduce_in_buckets(tensors, lambda flat: reduce(flat).wait())
