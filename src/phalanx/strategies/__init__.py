"""The strategies: one file each over the shared base in `strategy.py`."""

from phalanx.strategies.central_storage import CentralStorageStrategy
from phalanx.strategies.default import DefaultStrategy
from phalanx.strategies.mirrored import MirroredStrategy
from phalanx.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy
from phalanx.strategies.one_device import OneDeviceStrategy
from phalanx.strategies.parameter_server import ParameterServerStrategy
from phalanx.strategies.replica_context import ReplicaContext
from phalanx.strategies.strategy import Strategy, ValueContext

__all__ = [
    "CentralStorageStrategy",
    "DefaultStrategy",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "OneDeviceStrategy",
    "ParameterServerStrategy",
    "ReplicaContext",
    "Strategy",
    "ValueContext",
]
