"""``phalanx.data.experimental``: tf.data.experimental's names that distributed programs use.

TF programs spell the sharding policy ``tf.data.experimental.AutoShardPolicy`` and the
distribution options ``tf.data.experimental.DistributeOptions``; these are the same objects as
`phalanx.data.AutoShardPolicy` and `phalanx.data.DistributeOptions`.
"""

from phalanx.data.cardinality import INFINITE as INFINITE_CARDINALITY
from phalanx.data.cardinality import UNKNOWN as UNKNOWN_CARDINALITY
from phalanx.data.dataset_options import DistributeOptions
from phalanx.data.parallel import AUTOTUNE
from phalanx.input.input_options import AutoShardPolicy

__all__ = ["AUTOTUNE", "INFINITE_CARDINALITY", "UNKNOWN_CARDINALITY", "AutoShardPolicy", "DistributeOptions"]
