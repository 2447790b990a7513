"""Small TF spellings and guards: MultiWorkerMirroredStrategy(communication=...),
write_dirpath given a file path, the warning for an undistributed batch in strategy.run, and
Strategy.make_experimental_numpy_dataset."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import phalanx
from phalanx.cluster import SimpleClusterResolver
from phalanx.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy
from phalanx.strategies.workers.distributed_files import remove_temp_dirpath, write_dirpath


@pytest.fixture(autouse=True)
def _no_cluster_env(monkeypatch):
    for name in ("TF_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)


def test_the_deprecated_communication_argument_maps_to_communication_options():
    ring = phalanx.experimental.CollectiveCommunication.RING
    with pytest.warns(DeprecationWarning, match=r"communication=\.\.\.\) is deprecated"):
        strategy = MultiWorkerMirroredStrategy(communication=ring)
    try:
        assert strategy.communication_options.implementation is phalanx.CommunicationImplementation.RING
    finally:
        strategy.close()
    with pytest.raises(ValueError, match=r"not both.*HINT: communication_options="):
        MultiWorkerMirroredStrategy(communication=ring, communication_options=phalanx.CommunicationOptions())


class _Worker:
    is_chief = False
    cluster_resolver = SimpleClusterResolver({"worker": ["a:1", "b:2"]}, task_type="worker", task_id=1)


def test_write_dirpath_given_a_file_path_leaves_the_chiefs_file_a_file(tmp_path):
    target = tmp_path / "model.pt"
    worker_path = write_dirpath(str(target), _Worker())
    assert worker_path == str(tmp_path / "workertemp_1" / "model.pt")
    assert not target.exists()  # no folder where the chief writes its file
    torch.save({"w": 1}, write_dirpath(str(target), None))  # the chief (no strategy) saves the file
    assert target.is_file()
    remove_temp_dirpath(str(target), _Worker())
    assert not (tmp_path / "workertemp_1").exists()
    folder = write_dirpath(str(tmp_path / "logs"), _Worker())  # a folder stays a folder
    assert folder == str(tmp_path / "logs" / "workertemp_1")


def test_run_warns_once_when_replicas_get_the_same_global_batch(mirrored_2cpu):
    batch = torch.ones(8, 3)
    with pytest.warns(UserWarning, match=r"plain tensor of shape \(8, 3\).*counted 2 times.*HINT"):
        mirrored_2cpu.run(lambda x: x.sum(), args=(batch,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mirrored_2cpu.run(lambda x: x.sum(), args=(batch,))  # once per strategy
        mirrored_2cpu.run(lambda x: x * 2, args=(torch.tensor(3.0),))  # a scalar is a constant


def test_one_replica_gets_no_warning(one_device):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        one_device.run(lambda x: x.sum(), args=(torch.ones(8, 3),))


def test_make_experimental_numpy_dataset_is_a_strategy_method(mirrored_2cpu):
    dataset = mirrored_2cpu.make_experimental_numpy_dataset((np.arange(8.0), np.arange(8)))
    batches = list(mirrored_2cpu.experimental_distribute_dataset(dataset.batch(4)))
    assert len(batches) == 2
    with pytest.raises(ValueError, match="NumPy array"):
        mirrored_2cpu.make_experimental_numpy_dataset([1, 2, 3])
