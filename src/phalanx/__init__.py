"""phalanx: tf.distribute's strategy system for PyTorch.

One training program moves from one device to many replicas, workers or machines by
changing the line that creates the strategy. Importing phalanx has no side effects: hooks
are installed the first time a strategy scope is entered.

The package imports lazily (PEP 562): ``import phalanx`` loads no submodule and not torch,
so the ``phalanx`` command answers ``--help`` at once; ``phalanx.X`` and ``from phalanx
import X`` import what X lives in on first access. The ``TYPE_CHECKING`` block names every
public object for type checkers and IDEs.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what each lazy name is, for type checkers and IDEs
    from phalanx import (
        callbacks,
        checkpoint,
        cluster,
        config,
        coordinator,
        data,
        errors,
        estimator,
        experimental,
        losses,
        metrics,
        nn,
        partitioners,
        saved_model,
        train,
    )
    from phalanx._hooks import remove_torch_hooks
    from phalanx.cluster import resolvers as cluster_resolver
    from phalanx.communication import (
        CrossDeviceOps,
        HierarchicalCopyAllReduce,
        NcclAllReduce,
        ReductionToOneDevice,
    )
    from phalanx.communication.local.options import (
        CommunicationImplementation,
        CommunicationOptions,
    )
    from phalanx.context import experimental_set_strategy, has_strategy, in_cross_replica_context
    from phalanx.input.distributed_dataset import DistributedDataset, DistributedIterator
    from phalanx.input.input_options import AutoShardPolicy, InputContext, InputOptions, InputReplicationMode
    from phalanx.keras import Model, SidecarEvaluator, load_model
    from phalanx.losses.averaging import compute_average_loss, scale_regularization_loss
    from phalanx.server import Server
    from phalanx.strategies import (
        CentralStorageStrategy,
        MirroredStrategy,
        MultiWorkerMirroredStrategy,
        OneDeviceStrategy,
        ParameterServerStrategy,
        ReplicaContext,
        RunOptions,
        Strategy,
        StrategyExtended,
    )
    from phalanx.strategies.default import get_replica_context, get_strategy
    from phalanx.values import DistributedValues, Mirrored, PerReplica, ReduceOp
    from phalanx.variables import (
        MirroredVariable,
        SyncOnReadVariable,
        Variable,
        VariableAggregation,
        VariableSynchronization,
    )

__version__ = "0.1.0.dev0"

# Public name -> (module, attribute); attribute None means the name is the module itself.
_SUBMODULES = (
    "callbacks",
    "checkpoint",
    "cluster",
    "config",
    "coordinator",
    "data",
    "errors",
    "estimator",
    "experimental",
    "losses",
    "metrics",
    "nn",
    "partitioners",
    "remove_torch_hooks",
    "saved_model",
    "train",
)
_NAMES: dict[str, tuple[str, str | None]] = {
    **{name: (f"phalanx.{name}", None) for name in _SUBMODULES},
    "cluster_resolver": ("phalanx.cluster.resolvers", None),
    "Server": ("phalanx.server", "Server"),
    **{
        name: ("phalanx.communication", name)
        for name in ("CrossDeviceOps", "HierarchicalCopyAllReduce", "NcclAllReduce", "ReductionToOneDevice")
    },
    **{
        name: ("phalanx.communication.local.options", name)
        for name in ("CommunicationImplementation", "CommunicationOptions")
    },
    **{
        name: ("phalanx.context", name)
        for name in ("experimental_set_strategy", "has_strategy", "in_cross_replica_context")
    },
    "get_replica_context": ("phalanx.strategies.default", "get_replica_context"),
    "get_strategy": ("phalanx.strategies.default", "get_strategy"),
    "DistributedDataset": ("phalanx.input.distributed_dataset", "DistributedDataset"),
    "DistributedIterator": ("phalanx.input.distributed_dataset", "DistributedIterator"),
    **{
        name: ("phalanx.input.input_options", name)
        for name in ("AutoShardPolicy", "InputContext", "InputOptions", "InputReplicationMode")
    },
    **{name: ("phalanx.keras", name) for name in ("Model", "SidecarEvaluator", "load_model")},
    "compute_average_loss": ("phalanx.losses.averaging", "compute_average_loss"),
    "scale_regularization_loss": ("phalanx.losses.averaging", "scale_regularization_loss"),
    "remove_torch_hooks": ("phalanx._hooks", "remove_torch_hooks"),
    **{
        name: ("phalanx.strategies", name)
        for name in (
            "CentralStorageStrategy",
            "MirroredStrategy",
            "MultiWorkerMirroredStrategy",
            "OneDeviceStrategy",
            "ParameterServerStrategy",
            "ReplicaContext",
            "RunOptions",
            "Strategy",
            "StrategyExtended",
        )
    },
    **{
        name: ("phalanx.values", name) for name in ("DistributedValues", "Mirrored", "PerReplica", "ReduceOp")
    },
    **{
        name: ("phalanx.variables", name)
        for name in (
            "MirroredVariable",
            "SyncOnReadVariable",
            "Variable",
            "VariableAggregation",
            "VariableSynchronization",
        )
    },
}

# Literal, so that tools see every name; tests/unit/test_public_api.py checks it matches _NAMES.
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
    "InputReplicationMode",
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
    "RunOptions",
    "Server",
    "SidecarEvaluator",
    "Strategy",
    "StrategyExtended",
    "SyncOnReadVariable",
    "Variable",
    "VariableAggregation",
    "VariableSynchronization",
    "__version__",
    "callbacks",
    "checkpoint",
    "cluster",
    "cluster_resolver",
    "compute_average_loss",
    "config",
    "coordinator",
    "data",
    "errors",
    "estimator",
    "experimental",
    "experimental_set_strategy",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "load_model",
    "losses",
    "metrics",
    "nn",
    "partitioners",
    "remove_torch_hooks",
    "saved_model",
    "scale_regularization_loss",
    "train",
]


def __getattr__(name: str) -> Any:
    """Imports a public name's module on first access and caches the name on the package.

    Other submodules (``phalanx.keras``, ``phalanx.strategies``, ...) import on first access
    too, as they did when ``import phalanx`` imported them all.

    Raises:
        AttributeError: ``name`` is neither a public name nor a submodule of phalanx.
    """
    if name in _NAMES:
        module_name, attribute = _NAMES[name]
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        module_name, attribute = f"{__name__}.{name}", None
    else:
        raise AttributeError(f"module 'phalanx' has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
