"""GradientBuckets without processes: a fake all-reduce in which every worker has our gradients."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from phalanx.communication.engine.bucketing import DEFAULT_BUCKET_BYTES, FIRST_BUCKET_BYTES, GradientBuckets

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


def _local_gradients(net, *batches):
    """The gradients one worker accumulates alone over ``batches`` (a copy of ``net``)."""
    alone = copy.deepcopy(net)
    for x in batches:
        alone(x).sum().backward()
    return [p.grad for p in alone.parameters()]


def test_sums_start_during_backward_and_are_in_grad_when_backward_returns():
    net = Net()
    recorder = Recorder(watch=net.first.weight)
    buckets = _buckets(net.parameters(), recorder, bucket_bytes=256, first_bucket_bytes=64)
    x = torch.randn(5, 8)
    local = _local_gradients(net, x)
    net(x).sum().backward()
    assert len(recorder.launched) == len(buckets.buckets)  # all started by the end of backward
    assert recorder.watched_grad_at_first_launch == [True]  # before the first layer's gradient existed
    for (name, p), want in zip(net.named_parameters(), local, strict=True):
        if name.startswith("unused"):
            assert p.grad is None  # no worker had one
            assert want is None
        else:
            torch.testing.assert_close(p.grad, WORKERS * want)


def test_accumulation_over_two_passes_sums_each_pass_once():
    net = Net()
    buckets = _buckets(net.parameters(), Recorder(), bucket_bytes=256)
    x1, x2 = torch.randn(3, 8), torch.randn(3, 8)
    local = _local_gradients(net, x1, x2)
    net(x1).sum().backward()
    net(x2).sum().backward()
    for p, want in zip(net.parameters(), local, strict=True):
        assert (p.grad is None) is (want is None)
        if want is not None:
            torch.testing.assert_close(p.grad, WORKERS * want)
    assert buckets.buckets


def test_an_edit_between_backward_and_the_next_pass_is_kept():
    net = Net()
    buckets = _buckets(net.parameters(), Recorder(), bucket_bytes=256)
    x1, x2 = torch.randn(3, 8), torch.randn(3, 8)
    net(x1).sum().backward()
    edited = {p: p.grad * 0.5 for p in net.parameters() if p.grad is not None}
    for p, g in edited.items():
        p.grad.copy_(g)  # e.g. clip_grad_norm_ acting on the sum
    delta = _local_gradients(net, x2)
    net(x2).sum().backward()
    for p, want in zip(net.parameters(), delta, strict=True):
        if want is not None:
            torch.testing.assert_close(p.grad, edited[p] + WORKERS * want)
    assert buckets.buckets


def test_autograd_grad_changes_no_gradient_and_starts_nothing():
    net = Net()
    recorder = Recorder()
    buckets = _buckets(net.parameters(), recorder)
    net(torch.randn(2, 8)).sum().backward()
    before = [None if p.grad is None else p.grad.clone() for p in net.parameters()]
    launched = len(recorder.launched)
    torch.autograd.grad(net(torch.randn(2, 8)).sum(), list(net.first.parameters()))
    assert len(recorder.launched) == launched
    for p, want in zip(net.parameters(), before, strict=True):
        assert (p.grad is None) if want is None else torch.equal(p.grad, want)
    assert buckets.buckets


def test_gradients_are_views_of_the_buckets_and_zeroing_in_place_still_works():
    net = Net()
    buckets = _buckets(net.parameters(), Recorder())
    for set_to_none in (False, False, True):  # the second round starts from views of the buckets
        net.zero_grad(set_to_none=set_to_none)
        x = torch.randn(4, 8)
        local = _local_gradients(net, x)
        net(x).sum().backward()
        torch.testing.assert_close(net.last.weight.grad, WORKERS * local[-2])
    assert net.last.weight.grad.untyped_storage().data_ptr() in {
        b.buffer.untyped_storage().data_ptr() for b in buckets._buckets
    }


def test_reentrant_checkpoint_is_summed_correctly():
    a, c = nn.Linear(4, 4), nn.Linear(4, 4)
    params = [*a.parameters(), *c.parameters()]
    recorder = Recorder()
    buckets = _buckets(params, recorder, bucket_bytes=64)
    x = torch.randn(2, 4)
    checkpoint(c, a(x), use_reentrant=True).sum().backward()  # an inner backward
    alone_a, alone_c = copy.deepcopy(a), copy.deepcopy(c)
    for p in params:
        p.grad = None
    alone_c(alone_a(x)).sum().backward()
    local = [p.grad for p in [*alone_a.parameters(), *alone_c.parameters()]]
    checkpoint(c, a(x), use_reentrant=True).sum().backward()
    for p, want in zip(params, local, strict=True):
        torch.testing.assert_close(p.grad, WORKERS * want)
    assert buckets.buckets


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
    torch.testing.assert_close(frozen.grad, torch.full((3,), 2.0 * WORKERS))
    assert not buckets.tracks(nn.Parameter(torch.zeros(1)))


class Embedder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 3, sparse=True)
        self.head = nn.Linear(3, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids)).sum()


def test_sparse_gradients_are_summed_apart_and_leave_the_buckets_after_the_first_round():
    net = Embedder()
    sparse_calls = []

    def sum_sparse(t):
        sparse_calls.append(t._nnz())
        return t * WORKERS

    buckets = GradientBuckets(
        Recorder().launch, lambda work, what: work.wait(), sum_sparse=sum_sparse, bucket_bytes=256
    )
    for p in net.parameters():
        buckets.add(p)
    assert any(net.embed.weight is p for b in buckets.buckets for p in b)
    for step in range(2):
        ids = torch.tensor([[1, 2], [2, 7]]) + step
        alone = copy.deepcopy(net)
        net.zero_grad()
        alone(ids).backward()
        net(ids).backward()
        assert net.embed.weight.grad.is_sparse
        want = WORKERS * alone.embed.weight.grad.to_dense()
        torch.testing.assert_close(net.embed.weight.grad.to_dense(), want)
        torch.testing.assert_close(net.head.weight.grad, WORKERS * alone.head.weight.grad)
    assert sparse_calls == [4, 4]  # one sparse sum per round, of the 4 looked-up rows
    assert not any(net.embed.weight is p for b in buckets.buckets for p in b)  # rebuilt without it


@pytest.mark.parametrize("dead_on", [WORKERS, WORKERS - 1])
def test_a_dead_parameter_leaves_the_buckets_once_it_died_on_every_worker(dead_on):
    keep, gone = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(5))
    # the fake sum multiplies by WORKERS: a slot dead here counts as dead on all WORKERS;
    # with one worker more in the job, one worker still holds it
    buckets = _buckets([keep, gone], Recorder(), workers=WORKERS if dead_on == WORKERS else WORKERS + 1)
    assert [[p.numel() for p in b] for b in buckets.buckets] == [[5, 3]]
    new = nn.Parameter(torch.ones(2))
    buckets.add(new)  # the buckets are rebuilt at the next round, without a hold on `gone`
    del gone
    gc.collect()
    (keep.sum() + new.sum()).backward()
    torch.testing.assert_close(keep.grad, torch.full((3,), float(WORKERS)))
    torch.testing.assert_close(new.grad, torch.full((2,), float(WORKERS)))
    layout = [[(p.numel(), p.device.type) for p in b] for b in buckets.buckets]
    if dead_on == WORKERS:
        assert layout == [[(2, "cpu"), (3, "cpu")]]  # forgotten on every worker at once
    else:
        assert layout == [[(2, "cpu"), (5, "meta"), (3, "cpu")]]  # zeros until all have dropped it
    keep.grad, new.grad = None, None
    (keep.sum() + new.sum()).backward()  # the next round still sums right
    torch.testing.assert_close(keep.grad, torch.full((3,), float(WORKERS)))


class Keeper(Recorder):
    def __init__(self) -> None:
        super().__init__()
        self.tensors: list[torch.Tensor] = []

    def launch(self, buffer: torch.Tensor) -> FakeWork:
        self.tensors.append(buffer)
        return super().launch(buffer)


def test_a_large_gradient_is_summed_in_place_alone_and_the_flags_ride_in_the_last_bucket():
    small, big, unused = (nn.Parameter(torch.ones(n)) for n in (4, 64, 64))
    recorder = Keeper()
    buckets = _buckets([small, unused, big], recorder, solo_bytes=256)  # 64 floats: 256 B, solo
    assert [[p.numel() for p in b] for b in buckets.buckets] == [[64], [64], [4]]
    (big * 2).sum().add(small.sum()).backward()
    # big alone, unused alone (zeros: no worker had a gradient), then small and 3 x 2 flags
    assert recorder.launched == [64, 64, 4 + 6]
    assert big.grad.data_ptr() == recorder.tensors[0].data_ptr()  # autograd's tensor, summed in place
    torch.testing.assert_close(big.grad, torch.full((64,), 2.0 * WORKERS))
    torch.testing.assert_close(small.grad, torch.full((4,), 1.0 * WORKERS))
    assert unused.grad is None
    for _ in range(2):  # accumulated: base + the pass's sum
        (big * 3).sum().backward()
    torch.testing.assert_close(big.grad, torch.full((64,), 8.0 * WORKERS))


def test_when_the_last_bucket_is_solo_the_flags_travel_alone():
    big = nn.Parameter(torch.ones(64))
    recorder = Recorder()
    buckets = _buckets([big], recorder, solo_bytes=256)
    (big * 2).sum().backward()
    assert recorder.launched == [64, 2]  # the gradient, then its two flags
    assert [[p.numel() for p in b] for b in buckets.buckets] == [[64]]
    torch.testing.assert_close(big.grad, torch.full((64,), 2.0 * WORKERS))


def test_each_pass_announces_its_all_reduces_once_before_the_first_and_the_last_keeps_a_spare_element():
    small, big = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(64))
    recorder, announced = Recorder(), []

    def announce(specs):
        announced.append((list(specs), len(recorder.launched)))

    wait = lambda work, what: work.wait()  # noqa: E731
    buckets = GradientBuckets(recorder.launch, wait, solo_bytes=256, announce=announce)
    for p in (small, big):
        buckets.add(p)
    for _ in range(2):
        (big * 2).sum().add(small.sum()).backward()
    # the big one alone, then the small one with 2 x 2 flags and the transport's element
    specs = [(64, torch.float32), (4 + 4 + 1, torch.float32)]
    # before each pass's first launch; the first pass's layout is new: "not the last pass's"
    assert announced == [([], 0), (specs, 0), (specs, 2)]
    assert recorder.launched == [64, 9, 64, 9]
    torch.testing.assert_close(small.grad, torch.full((4,), 2.0 * WORKERS))  # two passes' sums


def test_a_pass_after_the_buckets_were_rebuilt_says_its_all_reduces_are_not_the_last_ones():
    first, second = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(8))
    recorder, announced = Recorder(), []
    wait = lambda work, what: work.wait()  # noqa: E731
    buckets = GradientBuckets(recorder.launch, wait, announce=announced.append, announce_tail=3)
    buckets.add(first)
    first.sum().backward()
    assert announced == [[], [(4 + 2 + 3, torch.float32)]]  # 2 flags, the transport's 3
    buckets.add(second)  # a new layout: told at the next pass's first hook, not before
    assert len(announced) == 2
    assert [[p.numel() for p in b] for b in buckets.buckets] == [[8, 4]]
    assert len(announced) == 2
    (first.sum() + second.sum()).backward()
    assert announced[2:] == [[], [(12 + 4 + 3, torch.float32)]]


def test_released_buckets_launch_nothing_and_leave_plain_gradients():
    """An elastic job drops the buckets of a failed group: their hooks go, nothing waits."""
    net = Net()
    plain = copy.deepcopy(net)
    recorder = Recorder()
    buckets = _buckets(net.parameters(), recorder, workers=WORKERS)
    buckets.release()
    x = torch.randn(3, 8)
    net(x).sum().backward()
    plain(x).sum().backward()
    assert recorder.launched == []  # no all-reduce: the hooks are gone
    for mine, theirs in zip(net.parameters(), plain.parameters(), strict=True):
        assert (mine.grad is None) == (theirs.grad is None)
        if mine.grad is not None:
            assert torch.equal(mine.grad, theirs.grad)  # autograd's own (not x WORKERS)
