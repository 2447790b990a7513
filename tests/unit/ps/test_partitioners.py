"""phalanx.partitioners: how many shards a variable is split into (TF's rules)."""

from __future__ import annotations

import pytest
import torch


def test_partitioners_follow_tfs_rules():
    from phalanx.partitioners import FixedShardsPartitioner, MaxSizePartitioner, MinSizePartitioner
    from phalanx.ps.partitioners import shard_rows

    assert FixedShardsPartitioner(3)((10, 4), torch.float32) == [3, 1]
    assert FixedShardsPartitioner(3)((2, 4), torch.float32) == [2, 1]  # no empty shard
    assert MinSizePartitioner(min_shard_bytes=64, max_shards=4)((10, 4), torch.float32) == [2, 1]  # 160 B
    assert MinSizePartitioner(min_shard_bytes=1 << 20)((10, 4), torch.float32) == [1, 1]
    assert MaxSizePartitioner(max_shard_bytes=32)((10, 4), torch.float32) == [5, 1]  # 2 rows of 16 B
    assert MaxSizePartitioner(max_shard_bytes=32, max_shards=3)((10, 4), torch.float32) == [3, 1]
    assert shard_rows(10, 3) == [(0, 4), (4, 7), (7, 10)]
    with pytest.raises(ValueError, match="num_shards must be >= 1"):
        FixedShardsPartitioner(0)
    with pytest.raises(ValueError, match="must be >= 1"):
        MinSizePartitioner(min_shard_bytes=0)
    with pytest.raises(ValueError, match="must be >= 1"):
        MaxSizePartitioner(max_shard_bytes=0)
    with pytest.raises(ValueError, match="axis 0 only"):
        FixedShardsPartitioner(2)((4,), torch.float32, axis=1)
