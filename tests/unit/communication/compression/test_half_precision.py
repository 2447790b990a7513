"""``compression="fp16"``/``"bf16"`` without processes: workers are threads (`ThreadedSum`)."""

from __future__ import annotations

import pytest
import torch

from phalanx.communication.compression import CompressedAllReduce, make_compressor

from .threaded_sum import on_threads


def _sum_on_two_workers(compression, values):
    def worker(rank, sums):
        traffic = CompressedAllReduce(sums.launch(rank), make_compressor(compression, 2))
        flat = values[rank].clone()
        traffic.start(0, flat, [flat], True).finish(sums.wait)
        return flat, traffic

    return on_threads(2, worker)


@pytest.mark.parametrize(("compression", "rtol"), [("fp16", 2e-3), ("bf16", 1.6e-2)])
def test_the_sum_is_close_and_half_the_bytes_go(compression, rtol):
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(1000, generator=g), torch.randn(1000, generator=g)]
    (out0, traffic), (out1, _) = _sum_on_two_workers(compression, values)
    exact = values[0] + values[1]
    torch.testing.assert_close(out0, exact, rtol=rtol, atol=rtol * exact.abs().max().item())
    assert torch.equal(out0, out1)
    assert out0.dtype == torch.float32
    assert traffic.bytes_sent == 2000 == traffic.bytes_uncompressed // 2


def test_fp16_sums_beyond_its_range_without_overflow():
    # each part fits float16 (max 65504), the sum does not: divided by 2 workers on the wire
    values = [torch.full((4,), 40000.0), torch.full((4,), 30000.0)]
    (out, _), _ = _sum_on_two_workers("fp16", values)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, torch.full((4,), 70000.0), rtol=1e-3, atol=0)


def test_narrow_and_non_float_buckets_go_as_they_are():
    compressor = make_compressor("fp16", 2)
    assert compressor.applies(torch.float32)
    assert compressor.applies(torch.float64)
    for dtype in (torch.float16, torch.bfloat16, torch.int64):
        assert not compressor.applies(dtype)
    traffic = CompressedAllReduce(lambda t: t, compressor)
    flat = torch.ones(8, dtype=torch.float16)
    traffic.start(0, flat, [flat], True).finish(lambda work, what: None)
    assert traffic.bytes_sent == traffic.bytes_uncompressed == 16


def test_the_flag_bucket_is_never_compressed():
    launched = []
    traffic = CompressedAllReduce(lambda t: launched.append(t.dtype), make_compressor("bf16", 2))
    traffic.start(0, torch.ones(6), [], False).finish(lambda work, what: None)
    assert launched == [torch.float32]
