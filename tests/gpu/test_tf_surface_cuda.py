"""TF 2.21 members with a CUDA meaning (skipped without a GPU): placing per-replica datasets on
their device, the default devices of MirroredStrategy(), and group() on CUDA values."""

from __future__ import annotations

import pytest
import torch

import phalanx

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_placed_per_replica_datasets_make_their_tensors_on_the_replica_device():
    strategy = phalanx.OneDeviceStrategy("cuda:0")
    options = phalanx.InputOptions(
        experimental_replication_mode=phalanx.InputReplicationMode.PER_REPLICA,
        experimental_place_dataset_on_device=True,
        experimental_fetch_to_device=False,
    )

    def dataset_fn(ctx):
        def batches():
            for step in range(2):
                yield torch.full((2, 1), float(step))  # no device given: the default one

        return batches()

    batches = list(strategy.distribute_datasets_from_function(dataset_fn, options))
    assert [b.device.type for b in batches] == ["cuda", "cuda"]
    assert strategy.group(batches[-1] * 2) is None


def test_mirrored_strategy_defaults_to_every_gpu():
    strategy = phalanx.MirroredStrategy()
    assert strategy.extended.worker_devices == tuple(f"cuda:{i}" for i in range(torch.cuda.device_count()))
    assert strategy.extended.parameter_devices == strategy.extended.worker_devices
