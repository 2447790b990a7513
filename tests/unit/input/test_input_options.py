"""InputOptions, InputContext and AutoShardPolicy validation."""

from __future__ import annotations

import pytest

import phalanx


def test_input_options_and_context_validation():
    with pytest.raises(ValueError, match="divisible by num_replicas_in_sync"):
        phalanx.InputContext(1, 0, 2).get_per_replica_batch_size(33)
    with pytest.raises(ValueError, match="input_pipeline_id must be in"):
        phalanx.InputContext(2, 2, 2)
    with pytest.raises(ValueError, match="num_input_pipelines must be >= 1"):
        phalanx.InputContext(0, 0, 1)
    with pytest.raises(ValueError, match="num_replicas_in_sync must be >= 1"):
        phalanx.InputContext(1, 0, 0)
    with pytest.raises(ValueError, match="buffer_size must be >= 0"):
        phalanx.InputOptions(experimental_per_replica_buffer_size=-1)
    with pytest.raises(ValueError, match="PER_WORKER"):  # PER_REPLICA exists now: tf_surface tests it
        phalanx.InputOptions(experimental_replication_mode="PER_TASK")
    assert phalanx.AutoShardPolicy.coerce("file") is phalanx.AutoShardPolicy.FILE
    assert phalanx.AutoShardPolicy.coerce(-1) is phalanx.AutoShardPolicy.OFF
    with pytest.raises(ValueError, match="auto_shard_policy must be one of"):
        phalanx.AutoShardPolicy.coerce(7)
