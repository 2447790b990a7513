"""GradientBuckets without processes: a fake all-reduce in which every worker has our gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from phalanx.communication.bucketing import DEFAULT_BUCKET_BYTES, FIRST_BUCKET_BYTES, GradientBuckets

WORKERS = 3


class FakeWork:
    """An all-reduce among WORKERS identical workers: the sum is WORKERS x the buffer."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer

    def wait(self) -> None:
        self.buffer.mul_(WORKERS)


class Recorder:
    def __init__(self, watch: torch.Tensor | None = None) -> None:
        self.launched: list[int] = []
        self.watch = watch
        self.watched_grad_at_first_launch: list[bool] = []

    def launch(self, buffer: torch.Tensor) -> FakeWork:
        if not self.launched and self.watch is not None:
            self.watched_grad_at_first_launch.append(self.watch.grad is None)
        self.launched.append(buffer.numel())
        return FakeWork(buffer)


def _buckets(params, recorder, **kwargs):
    buckets = GradientBuckets(recorder.launch, lambda work, what: work.wait(), **kwargs)
    for p in params:
        buckets.add(p)
    return buckets


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 16)
        self.unused = nn.Linear(2, 2)
        self.last = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.relu(self.first(x)))


def test_buckets_follow_reverse_creation_order_with_a_small_first_bucket():
    params = [nn.Parameter(torch.zeros(n)) for n in (100, 300, 50, 400, 10)]  # float32: 4 bytes each
    buckets = _buckets(params, Recorder(), bucket_bytes=2000, first_bucket_bytes=500)
    # reversed: 10 (40 B; 400 more would pass the 500 B first bucket) | 400, 50 (1800 B of
    # 2000) | 300, 100
    assert [[p.numel() for p in b] for b in buckets.buckets] == [[10], [400, 50], [300, 100]]


def test_dtypes_and_sizes_make_separate_buckets():
    small = nn.Parameter(torch.zeros(4))
    double = nn.Parameter(torch.zeros(4, dtype=torch.float64))
    big = nn.Parameter(torch.zeros(4))
    buckets = _buckets([small, double, big], Recorder())
    assert [[p.dtype for p in b] for b in buckets.buckets] == [
        [torch.float32, torch.float32],
        [torch.float64],
    ]
    assert FIRST_BUCKET_BYTES < DEFAULT_BUCKET_BYTES == 25 * 1024 * 1024


def test_sums_start_during_backward_and_unused_parameters_keep_no_gradient():
    net = Net()
    recorder = Recorder(watch=net.first.weight)
    buckets = _buckets(net.parameters(), recorder, bucket_bytes=256, first_bucket_bytes=64)
    loss = net(torch.randn(5, 8)).square().sum()
    loss.backward()
    local = {name: p.grad.clone() for name, p in net.named_parameters() if p.grad is not None}
    assert len(recorder.launched) == len(buckets.buckets)  # all started by the end of backward
    assert recorder.watched_grad_at_first_launch == [True]  # before the first layer's gradient existed
    buckets.synchronize()
    for name, p in net.named_parameters():
        if name.startswith("unused"):
            assert p.grad is None  # no worker had one
        else:
            torch.testing.assert_close(p.grad, WORKERS * local[name])


def test_accumulation_over_two_passes_is_summed_once_and_a_second_synchronize_does_nothing():
    net = Net()
    buckets = _buckets(net.parameters(), Recorder(), bucket_bytes=256)
    x1, x2 = torch.randn(3, 8), torch.randn(3, 8)
    net(x1).sum().backward()
    net(x2).sum().backward()
    local = [p.grad.clone() if p.grad is not None else None for p in net.parameters()]
    buckets.synchronize()
    summed = [p.grad.clone() if p.grad is not None else None for p in net.parameters()]
    for got, want in zip(summed, local, strict=True):
        assert (got is None) is (want is None)
        if want is not None:
            torch.testing.assert_close(got, WORKERS * want)
    buckets.synchronize()  # a second optimizer's step: nothing new
    for p, want in zip(net.parameters(), summed, strict=True):
        assert (p.grad is None) if want is None else torch.equal(p.grad, want)


def test_gradients_are_views_of_the_buckets_and_zeroing_in_place_still_works():
    net = Net()
    buckets = _buckets(net.parameters(), Recorder())
    for _ in range(2):  # the second round starts from grads that are views of the buckets
        net.zero_grad(set_to_none=False)
        x = torch.randn(4, 8)
        net(x).sum().backward()
        local = net.last.weight.grad.clone()
        buckets.synchronize()
        torch.testing.assert_close(net.last.weight.grad, WORKERS * local)
    assert net.last.weight.grad.untyped_storage().data_ptr() in {
        b.buffer.untyped_storage().data_ptr() for b in buckets._buckets
    }


def test_reentrant_checkpoint_is_summed_correctly():
    a, c = nn.Linear(4, 4), nn.Linear(4, 4)
    params = [*a.parameters(), *c.parameters()]
    recorder = Recorder()
    buckets = _buckets(params, recorder, bucket_bytes=64)
    checkpoint(c, a(torch.randn(2, 4)), use_reentrant=True).sum().backward()  # an inner backward
    local = [p.grad.clone() for p in params]
    buckets.synchronize()
    for p, want in zip(params, local, strict=True):
        torch.testing.assert_close(p.grad, WORKERS * want)


def test_a_second_gradient_in_one_pass_after_its_bucket_started_is_an_error():
    a, c = nn.Linear(4, 4), nn.Linear(4, 4)
    buckets = _buckets([*a.parameters(), *c.parameters()], Recorder(), bucket_bytes=64)
    x = torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="second gradient in one backward pass.*use_reentrant=False"):
        c(checkpoint(a, a(x), use_reentrant=True)).sum().backward()  # a used inside and outside
    del buckets


def test_inactive_backward_passes_and_removed_hooks_launch_nothing():
    net = Net()
    recorder = Recorder()
    active = [False]
    buckets = _buckets(net.parameters(), recorder, is_active=lambda: active[0])
    net(torch.randn(2, 8)).sum().backward()
    assert recorder.launched == []
    active[0] = True
    buckets.close()
    net(torch.randn(2, 8)).sum().backward()
    assert recorder.launched == []


def test_parameters_frozen_at_creation_are_tracked_once_they_require_gradients():
    frozen = nn.Parameter(torch.zeros(3), requires_grad=False)
    live = nn.Parameter(torch.zeros(3))
    buckets = _buckets([frozen, live, live], Recorder())  # `live` twice: tied weights
    assert buckets.tracks(frozen)
    assert [len(b) for b in buckets.buckets] == [1]
    frozen.requires_grad_(True)
    buckets.refresh()
    assert [len(b) for b in buckets.buckets] == [2]
    (frozen * 2 + live).sum().backward()
    buckets.synchronize()
    torch.testing.assert_close(frozen.grad, torch.full((3,), 2.0 * WORKERS))
    assert not buckets.tracks(nn.Parameter(torch.zeros(1)))
