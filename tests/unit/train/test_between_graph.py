"""Between-graph replication in one process: each worker's loop is played in turn against real
ps servers (gRPC on 127.0.0.1). tests/multiprocess/test_tf1_cluster.py runs it in processes."""

from __future__ import annotations

import os

import pytest
import torch

import phalanx
from phalanx.cluster.resolvers import SimpleClusterResolver
from phalanx.train import MonitoredTrainingSession, StopAtStepHook

X = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
Y = X.sum(1, keepdim=True)


def _worker(cluster, task, seed=None):
    strategy = phalanx.train.replica_device_setter(
        cluster.spec, f"/job:worker/task:{task}", connect_timeout=10
    )
    cluster.closing.append(strategy)
    torch.manual_seed(task if seed is None else seed)
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    return strategy, model, optimizer


def _step(model, optimizer):
    def fn(x, y):
        optimizer.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        optimizer.step()
        return loss.detach()

    return fn


def test_workers_share_the_chiefs_variables_and_one_global_step(tf1_cluster, tmp_path):
    chief, m0, o0 = _worker(tf1_cluster, 0)
    other, m1, o1 = _worker(tf1_cluster, 1)
    assert (chief.is_chief, other.is_chief) == (True, False)
    assert not torch.equal(m0[0].weight, m1[0].weight)  # each built its own initial values
    hooks = [StopAtStepHook(last_step=40)]
    with MonitoredTrainingSession(
        chief, checkpoint_dir=str(tmp_path), hooks=hooks, save_checkpoint_steps=10
    ) as c:
        w = MonitoredTrainingSession(other, hooks=[StopAtStepHook(last_step=40)])
        assert torch.equal(m0[0].weight, m1[0].weight)  # the worker waited for and read the chief's
        losses = []
        while not c.should_stop():
            losses.append(float(c.run(_step(m0, o0), X, Y)))
            if not w.should_stop():
                w.run(_step(m1, o1), X, Y)
        assert w.should_stop()
    assert 40 <= c.global_step <= 41  # both workers' steps, one count (the worker may take one more)
    assert losses[-1] < 0.2 * losses[0]
    running_means = [float(m[1].running_mean.abs().sum()) for m in (m0, m1)]
    assert all(r > 0 for r in running_means)  # BatchNorm's statistics reached the ps from both
    assert phalanx.train.latest_checkpoint(str(tmp_path)).endswith(f"model.ckpt-{c.global_step}.pt")
    assert os.path.exists(tmp_path / "model.ckpt-0.pt")  # TF1 saves at the start too


def test_a_restarted_worker_rejoins_and_a_restarted_chief_restores(tf1_cluster, tmp_path):
    chief, m0, o0 = _worker(tf1_cluster, 0)
    with MonitoredTrainingSession(chief, checkpoint_dir=str(tmp_path), save_checkpoint_steps=5) as c:
        for _ in range(10):
            c.run(_step(m0, o0), X, Y)
    trained = m0[0].weight.detach().clone()
    # worker 1 "restarts": a new process would build the model from scratch with other values
    again, m1, o1 = _worker(tf1_cluster, 1, seed=123)
    w = MonitoredTrainingSession(again)
    assert torch.equal(m1[0].weight, trained)
    assert w.global_step == 10
    w.run(_step(m1, o1), X, Y)
    assert w.global_step == 11
    # the chief restarts: it restores the newest checkpoint (global step 10) into a fresh model
    restarted, m2, o2 = _worker(tf1_cluster, 0, seed=7)
    c2 = MonitoredTrainingSession(restarted, checkpoint_dir=str(tmp_path), save_checkpoint_steps=5)
    assert c2.global_step == 10
    assert torch.equal(m2[0].weight, trained)
    assert torch.equal(other_read(again, m1), trained)  # and wrote it to the ps tasks


def other_read(strategy, model):
    strategy.pull()
    return model[0].weight.detach().clone()


def test_a_worker_waiting_for_a_chief_that_never_comes_names_it(tf1_cluster):
    other, _, _ = _worker(tf1_cluster, 1)
    with pytest.raises(TimeoutError, match=r"worker:1 waited 0.5s for the chief.*\(worker:0\)"):
        MonitoredTrainingSession(other, max_wait_secs=0.5)


def test_configuration_errors(tf1_cluster):
    with pytest.raises(ValueError, match=r"keeps the variables on 'ps' tasks; the cluster has none"):
        phalanx.train.BetweenGraphStrategy(
            SimpleClusterResolver({"worker": tf1_cluster.spec["worker"]}, task_type="worker", task_id=0)
        )
    with pytest.raises(ValueError, match=r"runs on the 'chief' and 'worker' tasks. Received: task ps:0"):
        phalanx.train.BetweenGraphStrategy(SimpleClusterResolver(tf1_cluster.spec, task_type="ps", task_id=0))
    with pytest.raises(ValueError, match=r"'/job:<job>/task:<index>'. Received: 'worker:1'"):
        phalanx.train.replica_device_setter(tf1_cluster.spec, "worker:1")
    with pytest.raises(ValueError, match="exactly one of num_steps and last_step"):
        StopAtStepHook()
    with pytest.raises(ValueError, match=r"must know what to save.*Scaffold\(model=model"):
        MonitoredTrainingSession(checkpoint_dir="/tmp/unused")


def test_an_optimizer_over_a_tensor_made_outside_the_scope_is_refused(tf1_cluster):
    chief, model, _ = _worker(tf1_cluster, 0)
    stray = torch.nn.Linear(4, 1)  # outside the scope
    optimizer = torch.optim.SGD(stray.parameters(), lr=0.1)
    sess = MonitoredTrainingSession(chief)

    def fn():
        optimizer.zero_grad()
        stray(X).sum().backward()
        optimizer.step()

    with pytest.raises(ValueError, match=r"created in strategy.scope\(\).*HINT"):
        sess.run(fn)


def test_a_local_session_restores_its_scaffold_and_global_step(tmp_path):
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaffold = phalanx.train.Scaffold(model=model, optimizer=optimizer)
    with MonitoredTrainingSession(
        checkpoint_dir=str(tmp_path), scaffold=scaffold, hooks=[StopAtStepHook(last_step=7)]
    ) as s:
        while not s.should_stop():
            s.run(_step(model, optimizer), X, Y)
    assert s.global_step == 7
    fresh = torch.nn.Linear(4, 1)
    again = phalanx.train.Scaffold(model=fresh, optimizer=torch.optim.SGD(fresh.parameters(), lr=0.05))
    resumed = MonitoredTrainingSession(
        checkpoint_dir=str(tmp_path), scaffold=again, hooks=[StopAtStepHook(last_step=7)]
    )
    assert resumed.global_step == 7
    assert resumed.should_stop()
    assert torch.equal(fresh.weight, model.weight)
    with pytest.raises(RuntimeError, match="is closed"):
        s.run(lambda: None)
