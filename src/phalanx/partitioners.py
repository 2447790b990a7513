"""Variable partitioners for ParameterServerStrategy (tf.distribute.experimental.partitioners).

strategy = phalanx.ParameterServerStrategy(
    resolver, variable_partitioner=phalanx.partitioners.MinSizePartitioner(
        min_shard_bytes=256 << 10, max_shards=num_ps))
"""

from phalanx.ps.partitioners import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    Partitioner,
)

__all__ = ["FixedShardsPartitioner", "MaxSizePartitioner", "MinSizePartitioner", "Partitioner"]
