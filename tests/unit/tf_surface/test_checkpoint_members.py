"""tf.train.Checkpoint/CheckpointManager/CheckpointOptions members.

The preemption handler has its own tests in tests/unit/checkpoint/failure_handling.
"""

from __future__ import annotations

import pytest
import torch

import phalanx
from phalanx.checkpoint import Checkpoint, CheckpointManager, CheckpointOptions, Counter


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 2)


def test_save_counter_counts_saves_and_is_restored(tmp_path):
    checkpoint = Checkpoint(model=_model())
    assert int(checkpoint.save_counter) == 0
    checkpoint.save(str(tmp_path / "ckpt"))
    path = checkpoint.save(str(tmp_path / "ckpt"))
    assert path.endswith("ckpt-2.pt")
    assert int(checkpoint.save_counter) == 2
    assert phalanx.checkpoint.latest_checkpoint(str(tmp_path)) == path  # save lists it, as TF
    fresh = Checkpoint(model=_model(1)).restore(path)
    assert int(fresh.save_counter) == 2


def test_async_write_snapshots_the_state_and_sync_waits(tmp_path):
    model = _model()
    written = []
    checkpoint = Checkpoint(model=model)
    options = CheckpointOptions(enable_async=True, experimental_write_callbacks=[written.append])
    before = model.weight.detach().clone()
    path = checkpoint.save(str(tmp_path / "ckpt"), options=options)
    with torch.no_grad():
        model.weight.add_(100.0)  # after save returned: not in the file
    checkpoint.sync()
    assert written == [path]
    restored = _model(1)
    Checkpoint(model=restored).read(path)
    torch.testing.assert_close(restored.weight, before)
    assert CheckpointOptions(experimental_enable_async_checkpoint=True).asynchronous


def test_async_write_errors_come_back_at_sync(tmp_path):
    checkpoint = Checkpoint(model=_model())

    def fail(path):
        raise OSError(f"disk full writing {path}")

    checkpoint.write(
        str(tmp_path / "a.pt"), CheckpointOptions(enable_async=True, experimental_write_callbacks=[fail])
    )
    with pytest.raises(OSError, match="disk full writing"):
        checkpoint.sync()
    checkpoint.sync()  # reported once


def test_skip_slot_variables_restores_the_model_but_not_the_optimizer(tmp_path):
    model = _model()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    path = Checkpoint(model=model, optimizer=optimizer).write(str(tmp_path / "c.pt"))
    other = _model(1)
    other_optimizer = torch.optim.Adam(other.parameters())
    Checkpoint(model=other, optimizer=other_optimizer).read(
        path, options=CheckpointOptions(experimental_skip_slot_variables=True)
    )
    torch.testing.assert_close(other.weight, model.weight)
    assert other_optimizer.state_dict()["state"] == {}


def test_checkpoint_options_refusals():
    with pytest.raises(ValueError, match="must be None or a CPU device"):
        CheckpointOptions(experimental_io_device="/job:worker/device:GPU:0")
    assert CheckpointOptions(experimental_io_device="/job:localhost/device:CPU:0").experimental_io_device
    with pytest.raises(ValueError, match="torch.distributed.checkpoint"):
        CheckpointOptions(experimental_sharding_callback=lambda shards: shards)


def test_manager_interval_checkpoint_and_init_fn(tmp_path):
    step = Counter(0)
    checkpoint = Checkpoint(model=_model(), step=step)
    initialised = []
    manager = CheckpointManager(
        checkpoint,
        str(tmp_path),
        step_counter=step,
        checkpoint_interval=3,
        init_fn=lambda: initialised.append(1),
    )
    assert manager.checkpoint is checkpoint
    assert manager.checkpoint_interval == 3
    assert manager.restore_or_initialize() is None
    assert initialised == [1]
    saved = []
    for _ in range(7):
        saved.append(manager.save() is not None)
        step.assign_add(1)
    assert saved == [True, False, False, True, False, False, True]
    assert manager.save(check_interval=False) is not None
    manager.sync()
    assert CheckpointManager(checkpoint, str(tmp_path / "other")).checkpoint_interval is None
    with pytest.raises(ValueError, match="needs a step_counter"):
        CheckpointManager(checkpoint, str(tmp_path), checkpoint_interval=2)
    with pytest.raises(ValueError, match="positive integer or None"):
        CheckpointManager(checkpoint, str(tmp_path), step_counter=step, checkpoint_interval=0)
