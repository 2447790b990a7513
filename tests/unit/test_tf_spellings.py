"""TF's spellings: phalanx.experimental, phalanx.config, make_experimental_numpy_dataset."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import phalanx
from phalanx import config, experimental


def test_experimental_names_are_the_strategies_and_options():
    assert experimental.MultiWorkerMirroredStrategy is phalanx.MultiWorkerMirroredStrategy
    assert experimental.CentralStorageStrategy is phalanx.CentralStorageStrategy
    assert experimental.ParameterServerStrategy is phalanx.ParameterServerStrategy
    assert experimental.CommunicationOptions is phalanx.CommunicationOptions
    assert experimental.CommunicationImplementation is phalanx.CommunicationImplementation


def test_collective_communication_warns_and_names_the_replacement():
    with pytest.warns(DeprecationWarning, match="use phalanx.experimental.CommunicationImplementation"):
        old = experimental.CollectiveCommunication
    assert old.RING is phalanx.CommunicationImplementation.RING
    options = experimental.CommunicationOptions(implementation=old.RING)
    assert options.implementation is phalanx.CommunicationImplementation.RING


def test_current_names_do_not_warn_and_star_import_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert experimental.CommunicationImplementation.NCCL.value == "NCCL"
        exec("from phalanx.experimental import *", {})


def test_unknown_experimental_name_raises():
    with pytest.raises(AttributeError, match="TPUStrategy"):
        experimental.TPUStrategy  # noqa: B018


def test_central_storage_by_its_experimental_name_trains():
    strategy = experimental.CentralStorageStrategy(["cpu:0", "cpu:1"])
    assert strategy.num_replicas_in_sync == 2


# ---------------------------------------------------------------- phalanx.config


def test_physical_devices_are_the_cpu_and_each_gpu():
    devices = config.list_physical_devices()
    assert devices[0] == config.PhysicalDevice("/physical_device:CPU:0", "CPU")
    gpus = config.list_physical_devices("GPU")
    assert len(gpus) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert [d.device_type for d in devices] == ["CPU"] + ["GPU"] * len(gpus)
    assert config.list_physical_devices("cpu") == devices[:1]


def test_logical_cpus_follow_the_configuration_and_work_in_a_strategy():
    cpu = config.list_physical_devices("CPU")[0]
    assert [d.name for d in config.list_logical_devices("CPU")] == ["/device:CPU:0"]
    try:
        config.set_logical_device_configuration(cpu, [config.LogicalDeviceConfiguration()] * 3)
        logical = config.list_logical_devices("CPU")
        assert [(d.name, d.device_type) for d in logical] == [(f"/device:CPU:{i}", "CPU") for i in range(3)]
        assert len(config.get_logical_device_configuration(cpu)) == 3
        strategy = phalanx.MirroredStrategy([d.name for d in logical])
        assert strategy.num_replicas_in_sync == 3
        assert strategy.extended.worker_devices == ("cpu:0", "cpu:1", "cpu:2")
    finally:
        config.set_logical_device_configuration(cpu, None)
    assert config.get_logical_device_configuration(cpu) is None
    assert len(config.list_logical_devices("CPU")) == 1


def test_unknown_device_type_and_device_are_refused():
    with pytest.raises(ValueError, match="no TPU"):
        config.list_logical_devices("TPU")
    with pytest.raises(ValueError, match="Unknown physical device '/physical_device:GPU:99'"):
        config.set_logical_device_configuration("/physical_device:GPU:99", [])


def test_a_gpu_cannot_be_split(monkeypatch):
    # No GPU here: pretend one exists, the refusal comes before torch.cuda is touched.
    monkeypatch.setattr(config, "_gpu_count", lambda: 1)
    gpu = config.list_physical_devices("GPU")[0]
    with pytest.raises(ValueError, match="cannot be split into several logical GPUs"):
        config.set_logical_device_configuration(gpu, [config.LogicalDeviceConfiguration()] * 2)
    assert config.get_logical_device_configuration(gpu) is None


# ------------------------------------------------------- make_experimental_numpy_dataset


def test_numpy_dataset_rows_are_distributed_across_replicas():
    features = np.arange(20, dtype=np.float32).reshape(10, 2)
    labels = np.arange(10)
    dataset = phalanx.get_strategy().make_experimental_numpy_dataset((features, labels))
    assert dataset.cardinality() == 10
    strategy = phalanx.MirroredStrategy(["cpu:0", "cpu:1"])
    seen = []
    for x, y in strategy.experimental_distribute_dataset(dataset.batch(4)):
        for local_x, local_y in zip(
            strategy.experimental_local_results(x), strategy.experimental_local_results(y), strict=True
        ):
            assert local_x.dtype == torch.float32
            seen += local_y.tolist()
            assert local_x[:, 0].tolist() == [2.0 * v for v in local_y.tolist()]
    assert sorted(seen) == list(range(10))


def test_numpy_dataset_shares_the_arrays_memory():
    array = np.zeros([4, 3], dtype=np.float64)
    first = next(iter(phalanx.get_strategy().make_experimental_numpy_dataset({"x": array})))
    array[0, 0] = 7.0
    assert first["x"].dtype == torch.float64
    assert (
        float(next(iter(phalanx.get_strategy().make_experimental_numpy_dataset({"x": array})))["x"][0]) == 7.0
    )


@pytest.mark.parametrize("bad", [[1, 2, 3], torch.ones(3), np.float32(1.0), (np.ones(3), "labels")])
def test_numpy_dataset_refuses_other_values(bad):
    with pytest.raises(ValueError, match="HINT: for tensors or other values use"):
        phalanx.get_strategy().make_experimental_numpy_dataset(bad)
