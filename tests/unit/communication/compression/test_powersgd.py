"""PowerSGD's math without processes: workers are threads summing through `ThreadedSum`."""

from __future__ import annotations

import pytest
import torch

from phalanx.communication.compression import CompressedAllReduce, PowerSGD, make_compressor
from phalanx.communication.compression.powersgd import PowerSGDCompressor

from .threaded_sum import on_threads


def _round(compressor, tensors, launch, wait, key=0):
    """One bucket of ``tensors`` (laid end to end) through ``compressor``: its result, per tensor."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    views, at = [], 0
    for t in tensors:
        views.append(flat[at : at + t.numel()].view(t.shape))
        at += t.numel()
    compressor.begin_round()
    compressor.start(key, flat, views, launch).finish(wait)
    return [v.clone() for v in views]


def _alone(tensor):
    return tensor


def _no_wait(work, what):
    return None


def _low_rank(rows, cols, rank, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, rank, generator=g) @ torch.randn(rank, cols, generator=g)


def test_a_matrix_of_the_rank_asked_for_comes_back_exactly():
    m = _low_rank(40, 30, 2, 0)
    compressor = PowerSGDCompressor(PowerSGD(rank=2, start_iteration=0), workers=1)
    (out,) = _round(compressor, [m.clone()], _alone, _no_wait)
    torch.testing.assert_close(out, m, rtol=1e-4, atol=1e-4)


def test_two_workers_get_the_same_approximation_of_the_sum():
    shared = torch.randn(40, 2, generator=torch.Generator().manual_seed(1))  # one column space

    def worker(rank, sums):
        m = shared @ torch.randn(2, 30, generator=torch.Generator().manual_seed(10 + rank))
        bias = torch.full((5,), float(rank + 1))
        compressor = PowerSGDCompressor(PowerSGD(rank=2, start_iteration=0), workers=2)
        return m, _round(compressor, [m.clone(), bias], sums.launch(rank), sums.wait)

    (m0, out0), (m1, out1) = on_threads(2, worker)
    torch.testing.assert_close(out0[0], m0 + m1, rtol=1e-4, atol=1e-4)  # a sum, rank 2: exact
    assert torch.equal(out0[0], out1[0])  # the same bits on every worker
    assert torch.equal(out0[1], torch.full((5,), 3.0))  # a vector goes uncompressed: exact


def test_error_feedback_carries_what_the_approximation_left_out():
    # one worker: every round's output plus the error still held is everything put in
    compressor = PowerSGDCompressor(PowerSGD(rank=1, start_iteration=0), workers=1)
    g = torch.Generator().manual_seed(2)
    put_in, came_out = torch.zeros(20, 16), torch.zeros(20, 16)
    for _ in range(6):
        m = torch.randn(20, 16, generator=g)
        put_in += m
        came_out += _round(compressor, [m], _alone, _no_wait)[0]
    memory = compressor.memory(0)
    assert memory is not None
    torch.testing.assert_close(came_out + memory.errors[0], put_in, rtol=1e-4, atol=1e-4)
    assert memory.errors[0].norm() > 0.1  # rank 1 of a random matrix leaves plenty out


def test_error_feedback_of_two_workers_sums_to_the_residual_of_the_sum():
    def worker(rank, sums):
        compressor = PowerSGDCompressor(PowerSGD(rank=1, start_iteration=0), workers=2)
        m = torch.randn(12, 10, generator=torch.Generator().manual_seed(rank))
        (out,) = _round(compressor, [m.clone()], sums.launch(rank), sums.wait)
        return m, out, compressor.memory(0).errors[0]

    (m0, out0, e0), (m1, out1, e1) = on_threads(2, worker)
    torch.testing.assert_close(e0 + e1, m0 + m1 - out0, rtol=1e-4, atol=1e-4)


def test_without_error_feedback_nothing_is_kept():
    compressor = PowerSGDCompressor(PowerSGD(rank=1, start_iteration=0, error_feedback=False), workers=1)
    _round(compressor, [torch.randn(20, 16)], _alone, _no_wait)
    assert compressor.memory(0).errors == {}


def test_warm_start_converges_to_the_best_rank_r_approximation():
    m = torch.randn(30, 20, generator=torch.Generator().manual_seed(3))
    u, s, vh = torch.linalg.svd(m)
    best = (u[:, :2] * s[:2]) @ vh[:2]
    compressor = PowerSGDCompressor(PowerSGD(rank=2, start_iteration=0, error_feedback=False), workers=1)
    first = _round(compressor, [m.clone()], _alone, _no_wait)[0]
    for _ in range(60):  # each round one more power iteration from the last Q
        out = _round(compressor, [m.clone()], _alone, _no_wait)[0]
    assert (out - best).norm() < 1e-3 * best.norm() < (first - best).norm()


def test_the_first_rounds_go_uncompressed_and_small_matrices_always_do():
    traffic = CompressedAllReduce(_alone, make_compressor(PowerSGD(rank=4, start_iteration=2), 1))
    tiny = torch.randn(3, 3)  # 4 * (3 + 3) * 2 > 9: never worth compressing
    big = torch.randn(64, 64)
    for round_ in range(1, 4):
        before = traffic.bytes_sent
        traffic.begin_round()
        flat = torch.cat([tiny.reshape(-1), big.reshape(-1)])
        views = [flat[:9].view(3, 3), flat[9:].view(64, 64)]
        traffic.start(1, flat, views, True).finish(_no_wait)
        sent = traffic.bytes_sent - before
        if round_ <= 2:
            assert torch.equal(views[0], tiny)
            assert torch.equal(views[1], big)
        else:
            assert torch.equal(views[0], tiny)  # exact: it went as it is
            assert sent == (9 + 4 * 64 + 4 * 64) * 4  # the tiny one and P (64 x 4), then Q (64 x 4)
    assert traffic.bytes_uncompressed == 3 * (9 + 64 * 64) * 4


def test_a_pass_sends_two_all_reduces_for_all_its_buckets_at_its_end():
    launched = []

    def launch(tensor):
        launched.append(tensor.numel())
        return tensor

    compressor = PowerSGDCompressor(PowerSGD(rank=2, start_iteration=0), workers=1)
    compressor.begin_round()
    buckets = [torch.randn(50, 40), torch.randn(30, 60)]
    expected = [b.clone() for b in buckets]
    started = [compressor.start(k, b.view(-1), [b], launch) for k, b in enumerate(buckets)]
    assert launched == []  # nothing goes while the pass still computes its buckets
    for s in started:
        s.finish(_no_wait)
    assert launched == [2 * (50 + 30), 2 * (40 + 60)]  # every P, then every Q
    for b, e in zip(buckets, expected, strict=True):
        assert 0 < (b - e).norm() < e.norm()  # each bucket got its own rank-2 approximation
    compressor.begin_round()  # the next pass starts a batch of its own
    compressor.start(0, buckets[0].view(-1), [buckets[0]], launch).finish(_no_wait)
    assert launched[2:] == [2 * 50, 2 * 40]


def test_reset_forgets_errors_and_warm_starts():
    compressor = PowerSGDCompressor(PowerSGD(rank=1, start_iteration=0), workers=1)
    _round(compressor, [torch.randn(20, 16)], _alone, _no_wait)
    assert compressor.memory(0) is not None
    compressor.reset()
    assert compressor.memory(0) is None


def test_narrow_dtypes_are_not_compressed():
    compressor = PowerSGDCompressor(PowerSGD(), workers=1)
    assert compressor.applies(torch.float32)
    assert compressor.applies(torch.float64)
    assert not compressor.applies(torch.float16)
    assert not compressor.applies(torch.bfloat16)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rank": 0}, "rank must be an integer >= 1"),
        ({"rank": 1.5}, "rank must be an integer >= 1"),
        ({"rank": True}, "rank must be an integer >= 1"),
        ({"start_iteration": -1}, "start_iteration must be an integer >= 0"),
        ({"min_compression_rate": 0.5}, "min_compression_rate must be >= 1"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PowerSGD(**kwargs)
