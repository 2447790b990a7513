"""TF 2.21 members that mean something under ParameterServerStrategy: colocate_vars_with,
parameter_devices, variable_created_in_scope and experimental_get_current_worker_index."""

from __future__ import annotations

import pytest
import torch

import phalanx
from phalanx.coordinator import ClusterCoordinator, experimental_get_current_worker_index


def test_colocated_variables_go_whole_to_the_ps_task_of_the_given_one(ps_1worker_2ps):
    strategy = ps_1worker_2ps.strategy(phalanx.partitioners.FixedShardsPartitioner(2))
    with strategy.scope():
        first = torch.nn.Linear(4, 1, bias=False)  # its weight: round-robin, on ps 0
        second = torch.nn.Linear(4, 4, bias=False)  # split over both ps tasks
        with strategy.extended.colocate_vars_with(first.weight):
            third = torch.nn.Linear(4, 4, bias=False)  # whole, on ps 0
    handles = {id(t): h for t, h in strategy._live()}
    assert handles[id(first.weight)].ps == 0
    assert len(handles[id(second.weight)].shards) == 2
    third_handle = handles[id(third.weight)]
    assert third_handle.ps == 0
    assert not third_handle.shards
    assert strategy.extended.variable_created_in_scope(third.weight)
    assert not strategy.extended.variable_created_in_scope(torch.ones(1))
    assert strategy.extended.parameter_devices == (
        "/job:ps/task:0/device:CPU:0",
        "/job:ps/task:1/device:CPU:0",
    )
    with pytest.raises(ValueError, match="needs a variable created in this strategy's scope"):
        strategy.colocate_vars_with(torch.ones(1))


def test_scheduled_functions_learn_their_worker_index(ps_2workers_1ps):
    strategy = ps_2workers_1ps.strategy()
    coordinator = ClusterCoordinator(strategy)
    results = [
        coordinator.schedule(lambda: (experimental_get_current_worker_index(), strategy.worker_index))
        for _ in range(10)
    ]
    coordinator.join()
    pairs = [r.fetch() for r in results]
    assert all(index == worker for index, worker in pairs)
    assert {index for index, _ in pairs} <= {0, 1}
    with pytest.raises(RuntimeError, match="inside a function scheduled with ClusterCoordinator.schedule"):
        experimental_get_current_worker_index()
    assert phalanx.coordinator.PerWorkerValue is phalanx.coordinator.PerWorkerValues
