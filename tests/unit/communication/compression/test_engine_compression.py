"""GradientBuckets with a compressor, one worker (the all-reduce leaves each tensor as it is)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from phalanx.communication.compression import PowerSGD, make_compressor
from phalanx.communication.engine.bucketing import FLAGS_RIDE_BYTES, GradientBuckets


class Recorder:
    def __init__(self) -> None:
        self.launched: list[torch.dtype] = []

    def launch(self, tensor: torch.Tensor) -> torch.Tensor:
        self.launched.append(tensor.dtype)
        return tensor


def _buckets(model, compression, recorder, **sizes):
    sizes.setdefault("flags_ride_bytes", 0)  # the flags alone, unless a test says otherwise
    buckets = GradientBuckets(
        recorder.launch,
        lambda work, what: None,
        bucket_bytes=40_000,
        compressor=make_compressor(compression, 1),
        **sizes,
    )
    for p in model.parameters():
        buckets.add(p)
    return buckets


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def test_fp16_buckets_go_in_half_precision_and_the_flags_alone_in_float32():
    model, plain = _model(), _model()
    recorder = Recorder()
    buckets = _buckets(model, "fp16", recorder)
    x = torch.randn(32, 64)
    model(x).square().sum().backward()
    plain(x).square().sum().backward()
    assert recorder.launched[:-1]
    assert set(recorder.launched[:-1]) == {torch.float16}
    assert recorder.launched[-1] == torch.float32  # the flags: exact counts, uncompressed
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-3, atol=2e-3 * q.grad.abs().max().item())
    traffic = buckets.traffic
    assert traffic.bytes_sent <= 0.51 * traffic.bytes_uncompressed


def test_a_small_last_bucket_carries_the_flags_uncompressed():
    # W1 (32 KB) is a solo bucket, compressed; the last bucket (b2, W2, b1: 5.7 KB) is under
    # the ride limit: it carries the flags and goes in float32, so no all-reduce of flags alone
    model, plain = _model(), _model()
    recorder = Recorder()
    buckets = _buckets(model, "fp16", recorder, solo_bytes=8192, flags_ride_bytes=FLAGS_RIDE_BYTES)
    x = torch.randn(32, 64)
    model(x).square().sum().backward()
    plain(x).square().sum().backward()
    assert recorder.launched == [torch.float16, torch.float32]
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-3, atol=2e-3 * q.grad.abs().max().item())
    sent, wide = buckets.traffic.bytes_sent, buckets.traffic.bytes_uncompressed
    assert sent < 0.6 * wide  # the solo bucket's bytes halved; the small one's kept


def test_a_last_bucket_over_the_ride_limit_leaves_the_flags_alone():
    model, recorder = _model(), Recorder()
    _buckets(model, "fp16", recorder, solo_bytes=8192, flags_ride_bytes=4096)  # 5.7 KB > 4 KB
    model(torch.randn(4, 64)).sum().backward()
    assert recorder.launched == [torch.float16, torch.float16, torch.float32]  # the flags last, alone


def test_under_powersgd_the_flags_stay_alone_even_after_a_small_last_bucket():
    # PowerSGD shrinks W2 (10 x 128) in the small last bucket: sending it wide would cost more
    sizes = []
    model, recorder = _model(), Recorder()
    recorder.launch = lambda tensor: sizes.append(tensor.numel()) or tensor
    compressor = PowerSGD(rank=1, start_iteration=0)
    _buckets(model, compressor, recorder, solo_bytes=8192, flags_ride_bytes=FLAGS_RIDE_BYTES)
    model(torch.randn(4, 64)).sum().backward()
    flags = 2 * 4  # "had a delta" and "dead here" for each of the 4 parameters
    assert flags in sizes  # alone
    assert 10 + 10 * 128 + 128 + flags not in sizes  # not riding with b2, W2 and b1, uncompressed


def _announced(compression):
    """What a pass announces before its first all-reduce, and what it then launches."""
    announced, launched = [], []

    def launch(tensor):
        launched.append((tensor.numel(), tensor.dtype))
        return tensor

    model = _model()
    buckets = GradientBuckets(
        launch,
        lambda work, what: None,
        bucket_bytes=40_000,
        compressor=make_compressor(compression, 1),
        flags_ride_bytes=0,
        announce=announced.append,
        announce_tail=3,
    )
    for p in model.parameters():
        buckets.add(p)
    model(torch.randn(4, 64)).sum().backward()
    return [specs for specs in announced if specs], launched  # [] only says "buckets rebuilt"


def test_a_half_precision_pass_is_announced_as_it_goes():
    announced, launched = _announced("fp16")
    assert announced == [launched]  # every all-reduce, in order, in the dtype it goes in
    assert {d for _, d in launched[:-1]} == {torch.float16}
    assert launched[-1][1] == torch.float32  # the flags, with the transport's tail of 3


def test_a_powersgd_pass_is_not_announced():
    announced, launched = _announced(PowerSGD(rank=1, start_iteration=0))
    assert announced == []
    assert launched


def test_powersgd_skips_sparse_gradients_and_narrow_buckets():
    torch.manual_seed(0)
    embedding = nn.Embedding(50, 8, sparse=True)
    half = nn.Linear(16, 16).to(torch.float16)
    dense = nn.Linear(64, 64)
    recorder = Recorder()
    modules = nn.ModuleList([embedding, half, dense])
    reference = copy.deepcopy(modules)
    buckets = _buckets(modules, PowerSGD(rank=1, start_iteration=0), recorder)
    for mods in (modules, reference):
        for _ in range(2):  # the first pass finds the embedding sparse, the second leaves it out
            for p in mods.parameters():
                p.grad = None
            ids = torch.tensor([1, 3, 3])
            loss = mods[0](ids).sum() + mods[1](torch.ones(2, 16, dtype=torch.float16)).float().sum()
            loss = loss + mods[2](torch.ones(2, 64)).sum()
            loss.backward()
    assert modules[0].weight.grad.is_sparse
    torch.testing.assert_close(modules[0].weight.grad.to_dense(), reference[0].weight.grad.to_dense())
    torch.testing.assert_close(modules[1].weight.grad, reference[1].weight.grad)  # float16: as it is
    assert torch.float16 in recorder.launched
    assert buckets.traffic.bytes_sent < buckets.traffic.bytes_uncompressed


def test_a_rebuild_of_the_buckets_resets_error_feedback():
    model = _model()
    buckets = _buckets(model, PowerSGD(rank=1, start_iteration=0), Recorder())
    model(torch.randn(4, 64)).sum().backward()
    compressor = buckets.traffic.compressor
    resets = []
    compressor.reset = lambda: resets.append(1)  # a spy: the state itself is tested elsewhere
    model(torch.randn(4, 64)).sum().backward()
    assert resets == []  # the same buckets: error feedback carries on
    buckets.add(nn.Parameter(torch.zeros(3)))  # a new parameter: rebuilt at the next pass
    model(torch.randn(4, 64)).sum().backward()
    assert resets == [1]
    buckets.reset_compression()  # a checkpoint restore
    assert resets == [1, 1]
