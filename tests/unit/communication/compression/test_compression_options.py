"""``CommunicationOptions(compression=...)``: what it accepts, and the strategies that refuse it."""

from __future__ import annotations

import pytest
from torch.distributed.fsdp import MixedPrecisionPolicy

import phalanx
from phalanx.experimental import CommunicationOptions, FullyShardedStrategy, PowerSGD


@pytest.fixture(autouse=True)
def _no_cluster_env(monkeypatch):
    for name in ("TF_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)


def test_names_and_powersgd_are_accepted():
    assert CommunicationOptions(compression="FP16").compression == "fp16"
    assert CommunicationOptions(compression="bf16").compression == "bf16"
    assert CommunicationOptions(compression=PowerSGD(rank=2)).compression == PowerSGD(rank=2)
    assert CommunicationOptions().compression is None


@pytest.mark.parametrize("bad", ["int8", "topk", 16, object()])
def test_an_unknown_compression_is_refused(bad):
    with pytest.raises(
        ValueError, match="compression must be None, 'fp16', 'bf16' or phalanx.experimental.PowerSGD"
    ):
        CommunicationOptions(compression=bad)


def test_several_devices_per_worker_cannot_compress():
    options = CommunicationOptions(compression="fp16")
    with pytest.raises(ValueError, match="one device per worker.*Received: compression='fp16' with devices"):
        phalanx.MultiWorkerMirroredStrategy(communication_options=options, devices=["cpu:0", "cpu:1"])


def test_fully_sharded_refuses_powersgd():
    options = CommunicationOptions(compression=PowerSGD(rank=2))
    with pytest.raises(
        ValueError, match="reduce-scatters gradient shards; PowerSGD.*HINT: use compression='bf16'"
    ):
        FullyShardedStrategy(communication_options=options)


def test_fully_sharded_refuses_a_compression_its_mixed_precision_contradicts():
    import torch

    options = CommunicationOptions(compression="fp16")
    policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    with pytest.raises(
        ValueError, match="disagree.*compression='fp16', mixed_precision.reduce_dtype=torch.bfloat16"
    ):
        FullyShardedStrategy(communication_options=options, mixed_precision=policy)


def test_fully_sharded_reduces_in_the_compression_dtype():
    import torch

    strategy = FullyShardedStrategy(communication_options=CommunicationOptions(compression="bf16"))
    try:
        assert strategy._mp_policy.reduce_dtype == torch.bfloat16
    finally:
        strategy.close()
