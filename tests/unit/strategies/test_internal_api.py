"""The strategy's internal API (read by phalanx's input pipeline, variables, replica context,
dropout and callbacks): what each strategy reports, and that it matches what `run` does."""

from __future__ import annotations

import torch
from torch import nn

import phalanx
from phalanx.strategies.central_storage import CentralStoragePolicy
from phalanx.strategies.replicas.rendezvous import ReplicaRendezvous
from phalanx.strategies.replicas.variable_policy import VariablePolicy

LAYOUT = {
    "default": (1, ("cpu",)),
    "one_device": (1, ("cpu",)),
    "mirrored_2cpu": (2, ("cpu", "cpu")),
    "central_storage_2cpu": (2, ("cpu", "cpu")),
}


def test_the_replica_layout_of_every_in_process_strategy(any_strategy, request):
    strategy = any_strategy
    local, device_types = LAYOUT[request.node.callspec.params["any_strategy"]]
    assert strategy.num_local_replicas == local
    assert strategy.num_workers_in_sync == 1
    assert strategy.worker_rank == 0
    assert strategy.first_replica_id == 0
    assert tuple(d.type for d in strategy.local_devices) == device_types
    assert isinstance(strategy.rendezvous, ReplicaRendezvous)
    assert isinstance(strategy.cross_device_ops, phalanx.ReductionToOneDevice)
    assert strategy.variable_policy.strategy is strategy
    assert strategy.num_replicas_in_sync == local


def test_each_strategy_owns_the_policy_that_makes_its_variables(mirrored_2cpu, central_storage_2cpu):
    assert type(mirrored_2cpu.variable_policy) is VariablePolicy
    policy = central_storage_2cpu.variable_policy
    assert isinstance(policy, CentralStoragePolicy)
    assert policy.parameter_device == torch.device("cpu")
    with central_storage_2cpu.scope():
        layer = nn.Linear(2, 2)
    assert policy.owns(layer.weight)
    assert not mirrored_2cpu.variable_policy.owns(layer.weight)
    assert [v for v in policy.variables()] == [layer.weight, layer.bias]


def test_replica_context_is_the_one_run_gives_each_replica(mirrored_2cpu):
    seen = mirrored_2cpu.run(lambda: phalanx.get_replica_context())
    assert mirrored_2cpu.experimental_local_results(seen) == (
        mirrored_2cpu.replica_context(0),
        mirrored_2cpu.replica_context(1),
    )
    assert [c.replica_id_in_sync_group for c in seen.values] == [0, 1]


def test_run_count_counts_runs_and_can_be_restored(any_strategy):
    start = any_strategy.run_count
    any_strategy.run(lambda: None)
    any_strategy.run(lambda: None)
    assert any_strategy.run_count == start + 2
    any_strategy.run_count = 41
    any_strategy.run(lambda: None)
    assert any_strategy.run_count == 42


def test_a_remembered_batch_gives_run_its_global_batch_size(mirrored_2cpu):
    batch = phalanx.values.PerReplica([torch.ones(3, 1), torch.ones(2, 1)])
    mirrored_2cpu.remember_batch(batch, 10, [0, 3])

    def facts(x):
        ctx = phalanx.get_replica_context()
        return ctx.global_batch_size, ctx.example_offset

    global_size, offsets = mirrored_2cpu.run(facts, args=(batch,))
    assert global_size == 10  # the same on both replicas: regrouped to a plain value
    assert mirrored_2cpu.experimental_local_results(offsets) == (0, 3)


def test_a_variable_policy_forgets_variables_that_died(mirrored_2cpu):
    with mirrored_2cpu.scope():
        kept = nn.Linear(2, 2)
        dropped = nn.Linear(2, 2)
    policy = mirrored_2cpu.variable_policy
    del dropped
    import gc

    gc.collect()
    mirrored_2cpu.run(lambda: None)  # materialize_all runs before each run
    assert list(policy.variables()) == [kept.weight, kept.bias]
    assert policy.has_variables
    assert len(policy._variables) == 2


def test_a_variable_tells_its_strategy_when_it_needs_mirroring(mirrored_2cpu):
    with mirrored_2cpu.scope():
        layer = nn.Linear(2, 2)
    weight = layer.weight
    assert weight.strategy is mirrored_2cpu
    assert weight.aggregation is phalanx.VariableAggregation.NONE
    assert weight.plain_in_replica  # a parameter without aggregation: replicas read it plain
    assert weight.dirty  # new: its other components are made before the first run
    mirrored_2cpu.run(lambda: None)
    assert not weight.dirty
    assert weight.holds(weight.replica_leaf(1))
    assert not weight.holds(weight.replica_leaf(1).clone())
    with torch.no_grad():
        weight.add_(1.0)  # cross-replica write of the primary
    assert weight.dirty
    mirrored_2cpu.run(lambda: None)
    assert not weight.dirty
    torch.testing.assert_close(weight.replica_leaf(1), weight.primary)


def test_a_central_variable_holds_its_compute_leaves(central_storage_2cpu):
    with central_storage_2cpu.scope():
        layer = nn.Linear(2, 2)
    weight = layer.weight
    assert not weight.has_compute_leaves
    central_storage_2cpu.run(lambda: None)
    assert weight.has_compute_leaves
    assert weight.holds(weight.primary)
    assert weight.holds(weight.replica_leaf(1))
    assert central_storage_2cpu.extended.value_container(weight.replica_leaf(1)) is weight


def test_create_variable_makes_what_a_registration_would(mirrored_2cpu):
    with mirrored_2cpu.scope():
        param = mirrored_2cpu.create_variable(nn.Parameter(torch.ones(2)), is_parameter=True)
        buffer = mirrored_2cpu.create_variable(torch.zeros(2), is_parameter=False)
    assert isinstance(param, phalanx.MirroredVariable)
    assert isinstance(buffer, phalanx.SyncOnReadVariable)
    assert mirrored_2cpu.variable_policy.owns(param)
    assert buffer.aggregation is phalanx.VariableAggregation.MEAN  # a float buffer's default
    default = phalanx.get_strategy()
    assert default.create_variable(torch.ones(1), is_parameter=True) is None
