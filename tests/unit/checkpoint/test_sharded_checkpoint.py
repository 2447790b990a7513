"""Sharded (torch.distributed.checkpoint) checkpoints in one process: the format, and a folder
written by a stranger (DCP's metadata is a pickle: it must not run code).

Several workers, other world sizes and strategies: tests/multiprocess/test_sharded_checkpoints.py.
"""

from __future__ import annotations

import os
import pickle
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import phalanx
from phalanx.checkpoint import Counter, _sharded
from phalanx.train import Checkpoint


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_sharded_save_reads_back_weights_optimizer_state_and_counters(tmp_path):
    model, optimizer = _trained()
    path = Checkpoint(model=model, optimizer=optimizer, epoch=Counter(4)).save(
        str(tmp_path / "c"), sharded=True
    )
    assert path == str(tmp_path / "c-1.dcp")
    assert os.path.isfile(os.path.join(path, ".metadata"))
    assert [n for n in os.listdir(tmp_path) if n.startswith(".tmp-phalanx")] == []  # renamed into place
    other = nn.Linear(4, 3)
    other_optimizer = torch.optim.Adam(other.parameters(), lr=0.1)
    epoch = Counter(0)
    restored = Checkpoint(model=other, optimizer=other_optimizer, epoch=epoch).restore(
        str(tmp_path / "c-1.dcp")
    )
    assert epoch.value == 4
    assert restored.save_counter.value == 1
    torch.testing.assert_close(other.state_dict(), model.state_dict())
    state, expected = other_optimizer.state_dict()["state"], optimizer.state_dict()["state"]
    for index, entry in expected.items():
        torch.testing.assert_close(state[index]["exp_avg"], entry["exp_avg"])


def test_an_asynchronous_save_returns_a_future_of_the_folder(tmp_path):
    model, optimizer = _trained()
    future = Checkpoint(model=model, optimizer=optimizer).save(str(tmp_path / "a"), blocking=False)
    assert future.result(timeout=60) == str(tmp_path / "a-1.dcp")
    other = nn.Linear(4, 3)
    Checkpoint(model=other, optimizer=torch.optim.Adam(other.parameters())).read(future.result())
    torch.testing.assert_close(other.state_dict(), model.state_dict())


class _SlowWriter(dcp.FileSystemWriter):
    """Writes a moment late: the next save's staging comes first unless it waits."""

    def write_data(self, *args, **kwargs):
        time.sleep(0.3)
        return super().write_data(*args, **kwargs)


def test_asynchronous_saves_in_a_row_each_keep_the_state_of_their_own_moment(tmp_path, monkeypatch):
    # the staging copy is reused from one save to the next: a save may not overwrite it while
    # the previous one still writes from it, and a model of another layout gets a new copy
    monkeypatch.setattr(_sharded.dcp, "FileSystemWriter", _SlowWriter)
    model, optimizer = _trained()
    checkpoint = Checkpoint(model=model, optimizer=optimizer)
    futures, expected = [], []
    for step in range(3):
        with torch.no_grad():
            model.weight.fill_(float(step))
        futures.append(checkpoint.save(str(tmp_path / "a"), blocking=False))
        expected.append(model.weight.detach().clone())
    bigger = nn.Linear(8, 3)
    bigger_future = Checkpoint(model=bigger).save(str(tmp_path / "b"), blocking=False)
    for future, weight in zip(futures, expected, strict=True):
        other = nn.Linear(4, 3)
        restore = Checkpoint(model=other, optimizer=torch.optim.Adam(other.parameters()))
        restore.read(future.result(timeout=60))
        torch.testing.assert_close(other.weight, weight)
    restored = nn.Linear(8, 3)
    Checkpoint(model=restored).read(bigger_future.result(timeout=60))
    torch.testing.assert_close(restored.state_dict(), bigger.state_dict())


def test_a_save_that_waits_too_long_for_the_previous_one_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(_sharded, "STAGING_WAIT_SECONDS", 0.01)
    monkeypatch.setattr(_sharded.dcp, "FileSystemWriter", _SlowWriter)  # the first still writes
    model, optimizer = _trained()
    checkpoint = Checkpoint(model=model, optimizer=optimizer)
    first = checkpoint.save(str(tmp_path / "a"), blocking=False)
    with pytest.raises(TimeoutError, match="waited 0.01 s for the previous one"):
        checkpoint.save(str(tmp_path / "a"), blocking=False)
    assert first.result(timeout=60).endswith("a-1.dcp")


class _RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_crafted_metadata_is_refused_without_running_its_code(tmp_path):
    model, optimizer = _trained()
    path = Checkpoint(model=model, optimizer=optimizer).save(str(tmp_path / "c"), sharded=True)
    marker = tmp_path / "ran"
    payload = _RunsCode()
    payload.marker = str(marker)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(payload, f)
    with pytest.raises(ValueError, match=r"asks for posix\.system, which is not part of DCP's metadata"):
        Checkpoint(model=model, optimizer=optimizer).read(path)
    assert not marker.exists()


def test_metadata_that_is_not_dcps_is_refused(tmp_path):
    model, optimizer = _trained()
    path = Checkpoint(model=model, optimizer=optimizer).save(str(tmp_path / "c"), sharded=True)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump({"not": "metadata"}, f)
    with pytest.raises(ValueError, match="does not hold DCP metadata"):
        Checkpoint(model=model, optimizer=optimizer).read(path)


def test_an_asynchronous_single_file_save_is_refused_with_what_to_do(tmp_path):
    model, _ = _trained()
    with pytest.raises(ValueError, match="An asynchronous save writes a sharded checkpoint"):
        Checkpoint(model=model).save(str(tmp_path / "c"), sharded=False, blocking=False)


def test_an_optimizer_without_its_module_is_named(tmp_path):
    model, optimizer = _trained()
    with pytest.raises(ValueError, match="no module of this Checkpoint holds all of them"):
        Checkpoint(optimizer=optimizer).save(str(tmp_path / "c"), sharded=True)


def test_the_single_file_format_is_still_written_and_read_by_default(tmp_path):
    model, optimizer = _trained()
    path = Checkpoint(model=model, optimizer=optimizer).save(str(tmp_path / "c"))
    assert path.endswith("c-1.pt")
    assert os.path.isfile(path)
    with phalanx.OneDeviceStrategy("cpu:0").scope():
        Checkpoint(model=model, optimizer=optimizer).read(path)


def test_a_manager_keeps_sharded_folders_and_removes_old_ones(tmp_path):
    from phalanx.checkpoint import CheckpointManager
    from phalanx.experimental import FullyShardedStrategy

    strategy = FullyShardedStrategy()
    try:
        with strategy.scope():
            model = nn.Linear(4, 3)
        strategy.run(lambda: model(torch.ones(1, 4)))  # sharded (a group of one)
        manager = CheckpointManager(Checkpoint(model=model), str(tmp_path), max_to_keep=1)
        first = manager.save()
        second = manager.save()
        assert first.endswith("ckpt-1.dcp")
        assert not os.path.exists(first)
        assert manager.latest_checkpoint == second
        assert second.endswith("ckpt-2.dcp")
        expected = model.state_dict()
        with torch.no_grad():
            model.weight.zero_()
        manager.restore_or_initialize()
        torch.testing.assert_close(model.state_dict(), expected)
    finally:
        strategy.close()


def _fit(strategy, backup_dir: str, epochs: int) -> nn.Module:
    torch.manual_seed(1)
    with strategy.scope():
        module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        model = phalanx.Model(module)
        model.compile(
            optimizer=torch.optim.Adam(module.parameters(), lr=0.05),
            loss=phalanx.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(32, 4, generator=gen), torch.randint(0, 2, (32,), generator=gen)
    backup = phalanx.callbacks.BackupAndRestore(backup_dir, delete_checkpoint=False)
    model.fit(x.numpy(), y.numpy(), batch_size=8, epochs=epochs, callbacks=[backup], verbose=0, shuffle=False)
    return module


def test_backup_and_restore_of_a_sharded_model_resumes_from_a_sharded_backup(tmp_path):
    from phalanx.experimental import FullyShardedStrategy

    strategy = FullyShardedStrategy()
    try:
        trained = _fit(strategy, str(tmp_path), epochs=2)
        assert sorted(os.listdir(tmp_path)) == ["backup.dcp"]  # each worker its part, no backup.pt
        expected = trained.state_dict()
        resumed = _fit(strategy, str(tmp_path), epochs=2)  # both epochs done: nothing to train
        torch.testing.assert_close(resumed.state_dict(), expected)
        continued = _fit(strategy, str(tmp_path), epochs=3)  # one more epoch from the backup
        reference = _fit(phalanx.OneDeviceStrategy("cpu:0"), str(tmp_path / "one"), epochs=3)
        torch.testing.assert_close(continued.state_dict(), reference.state_dict(), rtol=1e-5, atol=1e-6)
    finally:
        strategy.close()
