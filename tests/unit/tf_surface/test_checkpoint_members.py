"""tf.train.Checkpoint/CheckpointManager/CheckpointOptions members and preemption handling."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

import phalanx
from phalanx.checkpoint import Checkpoint, CheckpointManager, CheckpointOptions, Counter
from phalanx.checkpoint.preemption import RESTART_CODE, _SigtermWatch


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


# ------------------------------------------------------------------ preemption


class _Exited(Exception):
    pass


def _exit():
    raise _Exited


def test_a_notice_saves_at_the_step_boundary_and_a_restart_continues(tmp_path):
    notice = threading.Event()
    model = _model()
    config = phalanx.experimental.TerminationConfig(termination_watcher_fn=notice.is_set, exit_fn=_exit)
    handler = phalanx.experimental.PreemptionCheckpointHandler(
        None, Checkpoint(model=model), str(tmp_path), config
    )
    ran = []
    for step in range(3):
        handler.run(ran.append, step)
    notice.set()
    with pytest.raises(_Exited):
        handler.run(ran.append, 3)
    assert ran == [0, 1, 2]
    assert handler.total_run_calls == 3
    assert sorted(os.listdir(tmp_path)) == ["checkpoint.json", "ckpt-3.pt"]
    restarted_model = _model(1)
    restarted = phalanx.experimental.PreemptionCheckpointHandler(
        None, CheckpointManager(Checkpoint(model=restarted_model), str(tmp_path)), None, config
    )
    assert restarted.total_run_calls == 3
    torch.testing.assert_close(restarted_model.weight, model.weight)


def test_sigterm_is_the_default_notice_and_the_default_exit_asks_for_a_restart(tmp_path):
    handler = phalanx.experimental.PreemptionCheckpointHandler(
        None, Checkpoint(model=_model()), str(tmp_path)
    )
    watch = handler._notice
    assert isinstance(watch, _SigtermWatch)
    try:
        handler.save_checkpoint_if_preempted()  # no notice: nothing happens
        assert os.listdir(tmp_path) == []
        os.kill(os.getpid(), signal.SIGTERM)
        assert watch.received.wait(10)
        with handler.watch_preemption_scope(), pytest.raises(SystemExit) as exited:
            handler.save_checkpoint_if_preempted(checkpoint_number=7)
        assert exited.value.code == RESTART_CODE
        assert "ckpt-7.pt" in os.listdir(tmp_path)
    finally:
        watch.uninstall()


def test_save_fn_replaces_the_manager_and_arguments_are_checked(tmp_path):
    saved = []
    config = phalanx.experimental.TerminationConfig(
        termination_watcher_fn=lambda: True, exit_fn=_exit, save_fn=lambda: saved.append(1), grace_period=30
    )
    handler = phalanx.experimental.PreemptionCheckpointHandler(
        None, Checkpoint(model=_model()), str(tmp_path), config
    )
    with pytest.raises(_Exited):
        handler.run(lambda: None)
    assert saved == [1]
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="needs checkpoint_dir"):
        phalanx.experimental.PreemptionCheckpointHandler(None, Checkpoint(model=_model()))
    manager = CheckpointManager(Checkpoint(model=_model()), str(tmp_path))
    with pytest.raises(ValueError, match="not with a CheckpointManager"):
        phalanx.experimental.PreemptionCheckpointHandler(None, manager, str(tmp_path))
    two_workers = phalanx.cluster_resolver.SimpleClusterResolver(
        {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, task_type="worker", task_id=0
    )
    with pytest.raises(ValueError, match=r"HINT: create it inside `with strategy.scope\(\):`"):
        phalanx.experimental.PreemptionCheckpointHandler(two_workers, manager, None, config)


def test_preemption_watcher_is_refused_with_the_replacement():
    with pytest.raises(
        NotImplementedError, match="HINT: use phalanx.experimental.PreemptionCheckpointHandler"
    ):
        phalanx.experimental.PreemptionWatcher()
    with pytest.raises(NotImplementedError, match="coordination service"):
        phalanx.experimental.PreemptionWatcher.block_until_worker_exit(None)
    assert phalanx.experimental.PreemptionWatcher.preemption_message is None
