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
        "coordinator",
        "compute_average_loss",
        "config",
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
)


def test_public_names_are_frozen():
    assert sorted(phalanx.__all__) == EXPECTED
    assert sorted([*phalanx._NAMES, "__version__"]) == EXPECTED  # the lazy table knows every name
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


def test_import_is_lazy_and_every_name_still_resolves():
    # `import phalanx` loads neither torch nor a submodule; each public name imports on first use.
    code = (
        "import sys; import phalanx; assert 'torch' not in sys.modules, 'torch imported'; "
        "assert 'phalanx.strategies' not in sys.modules; "
        "from phalanx import Model, MirroredStrategy, cluster_resolver, losses; "
        "assert MirroredStrategy is phalanx.MirroredStrategy; "
        "assert cluster_resolver is sys.modules['phalanx.cluster.resolvers']; "
        "assert all(getattr(phalanx, n) is not None for n in phalanx.__all__); "
        "assert set(phalanx.__all__) <= set(dir(phalanx)); print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_unknown_name_raises_attribute_error():
    import pytest

    with pytest.raises(AttributeError, match="no attribute 'NoSuchStrategy'"):
        phalanx.NoSuchStrategy  # noqa: B018
    with pytest.raises(ImportError):
        exec("from phalanx import NoSuchStrategy")


def test_experimental_names_are_frozen():
    import phalanx.experimental

    assert sorted(phalanx.experimental.__all__) == [
        "CentralStorageStrategy",
        "CommunicationImplementation",
        "CommunicationOptions",
        "DeviceMesh",
        "FullyShardedStrategy",
        "LayoutMap",
        "ModelParallelStrategy",
        "MultiWorkerMirroredStrategy",
        "ParameterServerStrategy",
        "PreemptionCheckpointHandler",
        "PreemptionWatcher",
        "TensorLayout",
        "TerminationConfig",
        "ValueContext",
        "coordinator",
        "partitioners",
        "rpc",
    ]
