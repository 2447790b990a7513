"""PreemptionCheckpointHandler in one process (OneDevice, Mirrored): a real SIGTERM to this
process saves, "exits" (an exit_fn that raises), and a new handler resumes to the weights of
an uninterrupted run."""

import json
import logging
import os
import signal

import pytest
import torch
from torch import nn

import phalanx
from phalanx.checkpoint import Checkpoint, CheckpointManager
from phalanx.checkpoint.failure_handling.handler import STATE_FILE
from phalanx.cluster.resolvers import SimpleClusterResolver
from phalanx.experimental import PreemptionCheckpointHandler, PreemptionWatcher, TerminationConfig

STEPS = 12
BATCHES = torch.randn(STEPS, 8, 4, generator=torch.Generator().manual_seed(3))


class Exited(Exception):
    """What the tests' exit_fn raises instead of leaving the interpreter."""


def _exit():
    raise Exited


def _model(strategy):
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    return model, optimizer


def _step(strategy, model, optimizer, x):
    def replica_step(inputs):
        loss = model(inputs).square().sum() / 8
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    def shard(ctx):  # each replica its rows of the global batch
        return x[ctx.replica_id_in_sync_group :: ctx.num_replicas_in_sync]

    return strategy.run(replica_step, args=(strategy.experimental_distribute_values_from_function(shard),))


def _handler(strategy, model, optimizer, directory, **config):
    with strategy.scope():
        checkpoint = Checkpoint(model=model, optimizer=optimizer)
        return PreemptionCheckpointHandler(
            strategy.cluster_resolver, checkpoint, str(directory), TerminationConfig(exit_fn=_exit, **config)
        )


def _train(strategy, directory, sigterm_before=None):
    """Trains to STEPS through a handler; SIGTERMs this process before step ``sigterm_before``."""
    model, optimizer = _model(strategy)
    handler = _handler(strategy, model, optimizer, directory)
    start = handler.total_run_calls
    try:
        for i in range(start, STEPS):
            if i == sigterm_before:
                os.kill(os.getpid(), signal.SIGTERM)
            handler.run(_step, strategy, model, optimizer, BATCHES[i])
    finally:
        handler._coordinator.close()  # this process goes on: give SIGTERM back
    return start, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", ["one_device", "mirrored_2cpu"])
def test_sigterm_saves_exits_and_the_restart_ends_with_the_uninterrupted_weights(request, tmp_path, name):
    strategy = request.getfixturevalue(name)
    _, expected = _train(strategy, tmp_path / "reference")
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Exited):
        _train(strategy, tmp_path / "run", sigterm_before=7)
    assert signal.getsignal(signal.SIGTERM) is before  # given back before exit_fn
    state = json.loads((tmp_path / "run" / STATE_FILE).read_text())
    assert state["total_run_calls"] == 7
    assert state["checkpoint"] == "ckpt-1.pt"
    start, got = _train(strategy, tmp_path / "run")
    assert start == 7
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-7, msg=key)


def test_run_returns_the_result_and_counts_calls(one_device, tmp_path):
    model, optimizer = _model(one_device)
    handler = _handler(one_device, model, optimizer, tmp_path)
    try:
        assert handler.run(lambda a, b=0: a + b, 2, b=3) == 5
        assert handler.total_run_calls == 1
        handler.save_checkpoint_if_preempted()  # counts a step done elsewhere
        assert handler.total_run_calls == 2
        assert not os.path.exists(tmp_path / STATE_FILE)  # nothing to save without a notice
    finally:
        handler._coordinator.close()


def test_save_checkpoint_if_preempted_counts_the_step_then_saves_and_exits(one_device, tmp_path):
    model, optimizer = _model(one_device)
    handler = _handler(one_device, model, optimizer, tmp_path)
    _step(one_device, model, optimizer, BATCHES[0])
    handler.save_checkpoint_if_preempted()
    _step(one_device, model, optimizer, BATCHES[1])
    handler._coordinator.notice.mark("received SIGTERM")
    with pytest.raises(Exited):
        handler.save_checkpoint_if_preempted()
    assert json.loads((tmp_path / STATE_FILE).read_text())["total_run_calls"] == 2


def test_grace_period_saves_at_once_trains_on_and_saves_again_before_the_end(one_device, tmp_path):
    saves = []
    model, optimizer = _model(one_device)
    handler = _handler(one_device, model, optimizer, tmp_path, grace_period=3600)
    manager = handler._manager
    handler._save_fn = lambda: saves.append(manager.save())
    late = [0.0]
    handler._coordinator.clock = lambda: handler._coordinator.notice.received_at + late[0]
    handler._coordinator.notice.mark("received SIGTERM")
    handler.run(_step, one_device, model, optimizer, BATCHES[0])  # first save, then the step
    handler.run(_step, one_device, model, optimizer, BATCHES[1])  # training on
    assert len(saves) == 1
    late[0] = 3600.0  # the grace period is over
    with pytest.raises(Exited):
        handler.run(_step, one_device, model, optimizer, BATCHES[2])
    assert len(saves) == 2
    assert json.loads((tmp_path / STATE_FILE).read_text())["total_run_calls"] == 2


def test_a_checkpoint_manager_is_used_as_it_is(one_device, tmp_path):
    model, optimizer = _model(one_device)
    with one_device.scope():
        manager = CheckpointManager(
            Checkpoint(model=model), str(tmp_path), max_to_keep=3, checkpoint_name="mine"
        )
        handler = PreemptionCheckpointHandler(
            None, manager, termination_config=TerminationConfig(exit_fn=_exit)
        )
    handler._coordinator.notice.mark("received SIGTERM")
    with pytest.raises(Exited):
        handler.run(_step, one_device, model, optimizer, BATCHES[0])
    assert manager.latest_checkpoint.endswith("mine-1.pt")


def test_a_checkpoint_it_did_not_save_restores_weights_but_not_the_count(one_device, tmp_path, caplog):
    model, optimizer = _model(one_device)
    with one_device.scope():
        CheckpointManager(Checkpoint(model=model, optimizer=optimizer), str(tmp_path)).save()
    with caplog.at_level(logging.WARNING, logger="phalanx"):
        handler = _handler(one_device, model, optimizer, tmp_path)
    handler._coordinator.close()
    assert handler.total_run_calls == 0
    assert "which it did not save itself" in caplog.text


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": "other"})])
def test_a_foreign_state_file_is_refused(one_device, tmp_path, content):
    model, optimizer = _model(one_device)
    with one_device.scope():
        CheckpointManager(Checkpoint(model=model, optimizer=optimizer), str(tmp_path)).save()
    (tmp_path / STATE_FILE).write_text(content)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(ValueError, match="is not a PreemptionCheckpointHandler state file"):
        _handler(one_device, model, optimizer, tmp_path)
    assert signal.getsignal(signal.SIGTERM) is before  # refused before SIGTERM was taken over


def test_a_checkpoint_needs_a_directory(one_device):
    model, _ = _model(one_device)
    with pytest.raises(ValueError, match="needs a checkpoint_dir"):
        PreemptionCheckpointHandler(None, Checkpoint(model=model))


def test_only_checkpoints_and_managers_are_accepted(tmp_path):
    with pytest.raises(TypeError, match="must be a phalanx.checkpoint.Checkpoint or CheckpointManager"):
        PreemptionCheckpointHandler(None, {"model": 1}, str(tmp_path))


def test_termination_config_must_be_one(one_device, tmp_path):
    model, _ = _model(one_device)
    with pytest.raises(TypeError, match="termination_config must be a TerminationConfig"):
        PreemptionCheckpointHandler(None, Checkpoint(model=model), str(tmp_path), {"grace_period": 1})


def test_a_cluster_of_several_workers_needs_the_strategy_that_joins_them(tmp_path):
    resolver = SimpleClusterResolver(
        {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, task_type="worker", task_id=0
    )
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="no live strategy was made with this cluster_resolver"):
        PreemptionCheckpointHandler(resolver, Checkpoint(model=model), str(tmp_path))


def test_a_watcher_function_that_raises_stops_training_with_its_error(one_device, tmp_path):
    def broken():
        raise OSError("metadata server unreachable")

    model, optimizer = _model(one_device)
    handler = _handler(one_device, model, optimizer, tmp_path, termination_watcher_fn=broken)
    handler._coordinator.notice._thread.join()
    with pytest.raises(RuntimeError, match="termination_watcher_fn of this worker raised OSError"):
        handler.run(_step, one_device, model, optimizer, BATCHES[0])
    handler._coordinator.close()


def test_a_watcher_function_notice_saves_and_exits(one_device, tmp_path):
    model, optimizer = _model(one_device)
    handler = _handler(one_device, model, optimizer, tmp_path, termination_watcher_fn=lambda: True)
    handler._coordinator.notice._thread.join()
    with pytest.raises(Exited):
        handler.run(_step, one_device, model, optimizer, BATCHES[0])
    assert (tmp_path / STATE_FILE).exists()


def test_errors_inside_watch_preemption_scope_propagate(one_device, tmp_path):
    model, optimizer = _model(one_device)
    handler = _handler(one_device, model, optimizer, tmp_path)
    try:
        with pytest.raises(ZeroDivisionError), handler.watch_preemption_scope():
            _ = 1 / 0
    finally:
        handler._coordinator.close()


def test_preemption_watcher_sees_the_notice_and_the_exit(one_device, tmp_path):
    model, optimizer = _model(one_device)
    handler = _handler(one_device, model, optimizer, tmp_path)
    with one_device.scope():
        watcher = PreemptionWatcher()
    assert watcher.preemption_message is None
    watcher.block_until_worker_exit(timeout=0)  # nobody was told to terminate
    handler._coordinator.notice.mark("received SIGTERM")
    handler._coordinator.board.post("notice", "received SIGTERM")  # as check() does
    with pytest.raises(TimeoutError, match=r"waiting for \['this worker'\] to save"):
        watcher.block_until_worker_exit(timeout=0)
    with pytest.raises(Exited):
        handler.run(_step, one_device, model, optimizer, BATCHES[0])
    assert watcher.preemption_message == "this worker received SIGTERM"
    watcher.block_until_worker_exit(timeout=0)


def test_experimental_exports_the_preemption_api():
    assert phalanx.experimental.PreemptionCheckpointHandler is PreemptionCheckpointHandler
    assert {"PreemptionCheckpointHandler", "PreemptionWatcher", "TerminationConfig"} <= set(
        phalanx.experimental.__all__
    )


def test_a_handler_made_after_the_scope_finds_the_strategy_of_its_resolver(tmp_path):
    resolver = SimpleClusterResolver({"worker": ["127.0.0.1:1"]}, task_type="worker", task_id=0)
    strategy = phalanx.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
    with strategy.scope():
        model = nn.Linear(2, 2)
    handler = PreemptionCheckpointHandler(resolver, Checkpoint(model=model), str(tmp_path))  # after the block
    assert handler._strategy is strategy
