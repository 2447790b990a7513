"""A client that is not a task of the cluster drives it (TF1's session target): ParameterServerStrategy
with a resolver that names no task coordinates like the chief."""

from __future__ import annotations

import pytest
import torch

import phalanx
from phalanx.cluster.resolvers import SimpleClusterResolver


def test_a_client_outside_the_cluster_trains_on_its_workers(tf1_cluster):
    strategy = phalanx.ParameterServerStrategy(SimpleClusterResolver(tf1_cluster.spec), connect_timeout=10)
    tf1_cluster.closing.append(strategy)
    coordinator = phalanx.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    x = torch.ones(8, 4)

    def step():
        def replica_fn():
            optimizer.zero_grad()
            loss = (model(x) - 1.0).pow(2).mean()
            loss.backward()
            optimizer.step()
            return loss.detach()

        return strategy.run(replica_fn), strategy.worker_index

    results = [coordinator.schedule(step) for _ in range(20)]
    coordinator.join()
    losses = [r.fetch()[0].item() for r in results]
    assert {r.fetch()[1] for r in results} <= {0, 1}  # the cluster's worker tasks ran them
    assert losses[-1] < losses[0]
    placement = [handle.ps for _, handle in strategy._live()]
    assert placement == [0, 1]  # the variables live on the ps tasks, round-robin
    assert strategy.is_chief  # the client writes the checkpoints


def test_a_client_is_refused_where_the_cluster_has_a_chief(tf1_cluster):
    spec = {"chief": ["127.0.0.1:1"], **tf1_cluster.spec}
    with pytest.raises(
        ValueError, match=r"outside the cluster \(no task_type\) coordinates only a cluster without"
    ):
        phalanx.ParameterServerStrategy(SimpleClusterResolver(spec))


def test_a_worker_task_is_pointed_to_between_graph_replication(tf1_cluster):
    resolver = SimpleClusterResolver(tf1_cluster.spec, task_type="worker", task_id=1)
    with pytest.raises(ValueError, match=r"task worker:1.*phalanx.train.replica_device_setter"):
        phalanx.ParameterServerStrategy(resolver)
