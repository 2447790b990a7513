"""Gradient compressors on CUDA tensors (skipped without a GPU): the buckets NCCL all-reduces."""

from __future__ import annotations

import pytest
import torch

from phalanx.communication.compression import CompressedAllReduce, PowerSGD, make_compressor

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _no_wait(work, what):
    return None


@pytest.mark.parametrize("compression", ["fp16", "bf16", PowerSGD(rank=2, start_iteration=0)])
def test_a_cuda_bucket_is_compressed_on_its_device(compression):
    launched = []

    def launch(tensor):
        launched.append(tensor.device.type)
        return tensor

    g = torch.Generator().manual_seed(0)
    matrix = (torch.randn(64, 2, generator=g) @ torch.randn(2, 48, generator=g)).cuda()  # rank 2
    flat = matrix.reshape(-1).clone()
    traffic = CompressedAllReduce(launch, make_compressor(compression, 1))
    traffic.begin_round()
    traffic.start(0, flat, [flat.view(64, 48)], True).finish(_no_wait)
    assert set(launched) == {"cuda"}
    assert traffic.bytes_sent < traffic.bytes_uncompressed
    torch.testing.assert_close(flat.view(64, 48), matrix, rtol=2e-2, atol=2e-2 * matrix.abs().max().item())
