"""The replica groups' gradient average started during the backward (a group of one rank): in
DDP's buckets (without its small first one) and DDP's order, every bucket started by the
backward's end, the averages written into the gradients, and a backward that makes a gradient
twice averaged again at its end.

The all-reduce here is the arithmetic of two groups' average against a fixed peer (this
process's gradient and the peer's, halved), started when the hooks call it and finished when
waited for, as torchft's ``Manager.allreduce`` work is; the launcher tests run the real one."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from accel_ctx._engines.replica_average import BackwardAverage


class PeerAverage:
    """Averages each flat buffer with a peer whose gradients are all ``peer``, when waited for;
    records what the backward had made when each bucket started."""

    def __init__(self, model: nn.Module, peer: float = 1.0) -> None:
        self.model, self.peer = model, peer
        self.started: list[tuple[int, list[str]]] = []  # (buffer size, the gradients made)

    def __call__(self, flat: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        made = [n for n, p in self.model.named_parameters() if p.grad is not None]
        self.started.append((flat.numel(), made))
        work: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        work.wait = lambda: flat.add_(self.peer).div_(2)  # type: ignore[method-assign]
        return work


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    # 1 MiB weights: under a 1 MiB cap (bucket_cap_mb=1) a bucket closes on each
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256), nn.ReLU(),
                         nn.Linear(256, 10))


def test_buckets_are_ddps_and_start_before_the_backward_ends() -> None:
    model = _model()
    peer = PeerAverage(model)
    average = BackwardAverage(peer, bucket_cap_mb=1)
    params = list(model.parameters())
    average.arm(params)
    x = torch.randn(8, 256)
    model(x).square().mean().backward()
    local = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert average.finish()
    indices, _ = dist._compute_bucket_assignment_by_size(  # type: ignore[attr-defined]
        params, [1024 * 1024])
    sizes = [sum(params[i].numel() for i in bucket) for bucket in reversed(indices)]
    assert [size for size, _ in peer.started] == sizes and len(sizes) == 3
    # the last layers' bucket started while the first layer's gradients were not made yet
    assert not {"0.weight", "0.bias"} & set(peer.started[0][1])
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, (local[name] + 1) / 2, rtol=0, atol=0)
    average.close()


def test_a_gradient_the_backward_does_not_make_is_left_alone_and_its_bucket_still_runs() -> None:
    model = _model()
    model[4].bias.requires_grad_(False)
    peer = PeerAverage(model)
    average = BackwardAverage(peer, bucket_cap_mb=1)
    params = [p for p in model.parameters() if p.requires_grad]
    average.arm(params)
    model[0].weight.grad = None
    out = model[2](torch.relu(model[0](torch.randn(4, 256))))  # the last layer not used
    out.sum().backward()
    assert average.finish()
    assert model[4].weight.grad is None and model[4].bias.grad is None
    assert len(peer.started) == 3  # every bucket, in order, with what it has
    average.close()


def test_a_gradient_made_twice_spoils_the_buckets_and_nothing_is_written() -> None:
    model = _model()
    peer = PeerAverage(model)
    average = BackwardAverage(peer)
    average.arm(list(model.parameters()))
    x = torch.randn(4, 256, requires_grad=True)  # a reentrant checkpoint needs one
    # a reentrant checkpoint runs its own backward: the first layer's gradients come then,
    # and the last layer is used twice (inside and outside), so it is made twice
    h = checkpoint(lambda t: model[4](model[3](model[2](model[1](model[0](t))))), x,
                   use_reentrant=True)
    (h.sum() + model[4](torch.randn(4, 256)).sum()).backward()
    local = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert average.finish() is False  # the caller averages at the end instead
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, local[name])
    average.close()


def test_hooks_do_nothing_unarmed_and_are_removed_at_close() -> None:
    model = _model()
    peer = PeerAverage(model)
    average = BackwardAverage(peer)
    average.arm(list(model.parameters()))
    assert average.finish() is True  # nothing made: every bucket started at the end
    peer.started.clear()
    model(torch.randn(2, 256)).sum().backward()  # not armed: an evaluation's backward, say
    assert peer.started == []
    average.close()
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
