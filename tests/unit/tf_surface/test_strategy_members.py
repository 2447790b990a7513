"""tf.distribute.Strategy / StrategyExtended / CrossDeviceOps members that TF 2.21 has."""

from __future__ import annotations

import pytest
import torch

import phalanx
from phalanx.communication import ReductionToOneDevice
from phalanx.values import Mirrored, PerReplica, ReduceOp


@pytest.fixture
def mirrored(mirrored_2cpu):
    return mirrored_2cpu


def test_strategy_extended_is_the_strategy(mirrored):
    assert phalanx.StrategyExtended is phalanx.Strategy
    assert isinstance(mirrored.extended, phalanx.StrategyExtended)
    assert mirrored.extended.worker_devices == ("cpu:0", "cpu:1")


def test_deprecated_spellings_warn_and_do_the_same(mirrored):
    value = PerReplica([torch.tensor(1.0), torch.tensor(2.0)])
    with pytest.warns(DeprecationWarning, match="use experimental_local_results"):
        assert mirrored.unwrap(value) == mirrored.experimental_local_results(value)
    with pytest.warns(DeprecationWarning, match="use distribute_datasets_from_function"):
        dataset = mirrored.experimental_distribute_datasets_from_function(
            lambda ctx: [torch.ones(2, 1), torch.zeros(3, 1)]
        )
    batch = next(iter(dataset))
    assert [t.shape for t in mirrored.experimental_local_results(batch)] == [(2, 1), (3, 1)]


def test_configure_is_refused_and_names_the_replacement(mirrored):
    with pytest.raises(NotImplementedError, match="no session to configure. HINT: give the cluster"):
        mirrored.configure(session_config=object())


def test_group_returns_none_as_tf_eager(mirrored):
    assert mirrored.group(PerReplica([torch.ones(1), torch.ones(1)])) is None
    assert mirrored.group(torch.ones(1), name="g") is None


def test_value_container_and_variable_created_in_scope(mirrored):
    with mirrored.scope():
        layer = torch.nn.Linear(2, 1)
    weight = layer.weight
    component = mirrored.experimental_local_results(weight)[1]
    assert mirrored.extended.value_container(component) is weight
    assert mirrored.extended.value_container(weight) is weight
    plain = torch.ones(1)
    assert mirrored.extended.value_container(plain) is plain
    assert mirrored.extended.variable_created_in_scope(weight)
    assert not mirrored.extended.variable_created_in_scope(plain)
    other = phalanx.MirroredStrategy(["cpu:0", "cpu:1"])
    assert not other.extended.variable_created_in_scope(weight)


def test_parameter_devices_and_static_shapes():
    assert phalanx.MirroredStrategy(["cpu:0", "cpu:1"]).extended.parameter_devices == ("cpu:0", "cpu:1")
    assert phalanx.OneDeviceStrategy("cpu:0").extended.parameter_devices == ("cpu:0",)
    central = phalanx.CentralStorageStrategy(["cpu:0", "cpu:1"])
    assert central.extended.parameter_devices == ("cpu:0",)
    assert central.extended.experimental_require_static_shapes is False


def test_colocate_vars_with_keeps_mirroring_and_refuses_foreign_values(mirrored):
    with mirrored.scope():
        first = torch.nn.Linear(2, 1)
        with mirrored.extended.colocate_vars_with(first.weight):
            second = torch.nn.Linear(2, 1)
    assert [c.device for c in mirrored.experimental_local_results(second.weight)] == [
        c.device for c in mirrored.experimental_local_results(first.weight)
    ]
    with mirrored.scope(), mirrored.colocate_vars_with(first.bias):
        pass
    with pytest.raises(ValueError, match="needs a variable created in this strategy's scope"):
        mirrored.colocate_vars_with(torch.ones(1))


def test_run_takes_run_options_and_refuses_other_options(mirrored):
    options = phalanx.RunOptions(experimental_enable_dynamic_batch_size=False)
    result = mirrored.run(lambda: torch.ones(1), options=options)
    assert [float(t) for t in mirrored.experimental_local_results(result)] == [1.0, 1.0]
    assert phalanx.RunOptions()._fields == (
        "experimental_enable_dynamic_batch_size",
        "experimental_bucketizing_dynamic_shape",
        "experimental_xla_options",
    )
    with pytest.raises(TypeError, match="must be a phalanx.RunOptions or None. Received: dict"):
        mirrored.run(lambda: None, options={"experimental_xla_options": None})


def test_value_context_is_experimental_and_declares_its_fields(mirrored):
    seen = []
    mirrored.experimental_distribute_values_from_function(lambda ctx: seen.append(ctx))
    assert all(isinstance(c, phalanx.experimental.ValueContext) for c in seen)
    assert [(c.replica_id_in_sync_group, c.num_replicas_in_sync) for c in seen] == [(0, 2), (1, 2)]


class _Doubling(ReductionToOneDevice):
    """TF's way to change a cross-device op: override the *_implementation hook."""

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options=None):
        return 2 * super().reduce_implementation(reduce_op, per_replica_value, destinations, options)


def test_cross_device_ops_call_their_implementation_hooks():
    ops = _Doubling()
    value = PerReplica([torch.tensor(1.0), torch.tensor(2.0)])
    assert float(ops.reduce(ReduceOp.SUM, value, "cpu")) == 6.0
    plain = ReductionToOneDevice()
    assert float(plain.reduce_implementation(ReduceOp.MEAN, value, "cpu")) == 1.5
    [batched] = plain.batch_reduce_implementation(ReduceOp.SUM, [(value, "cpu")])
    assert float(batched) == 3.0
    copies = plain.broadcast_implementation(torch.tensor(4.0), ["cpu", "cpu"])
    assert isinstance(copies, Mirrored)
    assert [float(c) for c in copies.values] == [4.0, 4.0]
    assert float(plain.broadcast_implementation(torch.tensor(4.0), "cpu")) == 4.0
