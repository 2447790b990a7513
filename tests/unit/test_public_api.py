"""The public surface is frozen here: changing it must be deliberate (update this list)."""

import subprocess
import sys

import phalanx

EXPECTED = sorted(
    [
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
        "compute_average_loss",
        "data",
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
        "scale_regularization_loss",
    ]
)


def test_public_names_are_frozen():
    assert sorted(phalanx.__all__) == EXPECTED
    for name in phalanx.__all__:
        assert hasattr(phalanx, name), name


def test_import_has_no_side_effects():
    code = (
        "import os, threading, torch; before = dict(os.environ); import phalanx; "
        "from torch.nn.modules import module; "
        "assert dict(os.environ) == before; assert threading.active_count() == 1; "
        "assert not module._global_parameter_registration_hooks; "
        "assert not torch.distributed.is_initialized()"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
