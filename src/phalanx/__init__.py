"""phalanx: tf.distribute's strategy system for PyTorch.

One training program moves from one device to many replicas, workers or machines by
changing the line that creates the strategy. Importing phalanx has no side effects: hooks
are installed the first time a strategy scope is entered.
"""

from phalanx import callbacks, checkpoint, cluster, coordinator, data, losses, metrics, nn, partitioners
from phalanx.cluster import resolvers as cluster_resolver
from phalanx.communication import (
    CrossDeviceOps,
    HierarchicalCopyAllReduce,
    NcclAllReduce,
    ReductionToOneDevice,
)
from phalanx.communication.communication_options import CommunicationImplementation, CommunicationOptions
from phalanx.context import (
    experimental_set_strategy,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)
from phalanx.input.distributed_dataset import DistributedDataset, DistributedIterator
from phalanx.input.input_options import AutoShardPolicy, InputContext, InputOptions
from phalanx.keras import Model, SidecarEvaluator, load_model
from phalanx.losses.averaging import compute_average_loss, scale_regularization_loss
from phalanx.ps.server import Server
from phalanx.strategies import (
    CentralStorageStrategy,
    MirroredStrategy,
    MultiWorkerMirroredStrategy,
    OneDeviceStrategy,
    ParameterServerStrategy,
    ReplicaContext,
    Strategy,
)
from phalanx.values import DistributedValues, Mirrored, PerReplica, ReduceOp
from phalanx.variables import (
    MirroredVariable,
    SyncOnReadVariable,
    VariableAggregation,
    VariableSynchronization,
)

__version__ = "0.1.0.dev0"

__all__ = [
    "AutoShardPolicy",
    "CentralStorageStrategy",
    "CommunicationImplementation",
    "CommunicationOptions",
    "CrossDeviceOps",
    "DistributedDataset",
    "DistributedIterator",
    "DistributedValues",
    "HierarchicalCopyAllReduce",
    "InputContext",
    "InputOptions",
    "Mirrored",
    "MirroredStrategy",
    "MirroredVariable",
    "Model",
    "MultiWorkerMirroredStrategy",
    "NcclAllReduce",
    "OneDeviceStrategy",
    "ParameterServerStrategy",
    "PerReplica",
    "ReduceOp",
    "ReductionToOneDevice",
    "ReplicaContext",
    "Server",
    "SidecarEvaluator",
    "Strategy",
    "SyncOnReadVariable",
    "VariableAggregation",
    "VariableSynchronization",
    "__version__",
    "callbacks",
    "checkpoint",
    "cluster",
    "cluster_resolver",
    "coordinator",
    "data",
    "load_model",
    "losses",
    "metrics",
    "nn",
    "partitioners",
    "compute_average_loss",
    "experimental_set_strategy",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "scale_regularization_loss",
]
