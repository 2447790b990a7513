"""phalanx.data: the tf.data subset the distribution guides use, built on torch.utils.data.

``Dataset`` chains sources and transformations (tf.data.Dataset); ``Options`` carries the
auto-shard policy the distribution layer reads; ``INFINITE`` and ``UNKNOWN`` are the
cardinality sentinels; ``AUTOTUNE`` lets phalanx pick a degree of parallelism;
``experimental`` holds tf.data.experimental's spellings (``AutoShardPolicy``, ...).
"""

from phalanx.data import experimental
from phalanx.data.cardinality import INFINITE, UNKNOWN
from phalanx.data.dataset import Dataset
from phalanx.data.dataset_options import DistributeOptions, Options
from phalanx.data.parallel import AUTOTUNE
from phalanx.input.input_options import AutoShardPolicy

__all__ = [
    "AUTOTUNE",
    "INFINITE",
    "UNKNOWN",
    "AutoShardPolicy",
    "Dataset",
    "DistributeOptions",
    "Options",
    "experimental",
]
