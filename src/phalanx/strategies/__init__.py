"""The strategies: one file each over the shared base in `strategy.py`."""

from phalanx.strategies.central_storage import CentralStorageStrategy
from phalanx.strategies.default import DefaultStrategy
from phalanx.strategies.mirrored import MirroredStrategy
from phalanx.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy
from phalanx.strategies.one_device import OneDeviceStrategy
from phalanx.strategies.parameter_server import ParameterServerStrategy
from phalanx.strategies.replica_context import ReplicaContext
from phalanx.strategies.run_options import RunOptions
from phalanx.strategies.strategy import Strategy, ValueContext

__all__ = [
    "CentralStorageStrategy",
    "DefaultStrategy",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "OneDeviceStrategy",
    "ParameterServerStrategy",
    "ReplicaContext",
    "RunOptions",
    "Strategy",
    "StrategyExtended",
    "ValueContext",
]

# tf.distribute.StrategyExtended: ``strategy.extended`` is the strategy itself (one class, no
# parallel "extended" object), so the extended type is `Strategy`.
StrategyExtended = Strategy
