"""tf.distribute's input surface: InputReplicationMode, InputOptions, element_spec, reduce."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext

import phalanx
from phalanx.input.distributed_dataset import DistributedDataset
from phalanx.input.element_spec import PerReplicaSpec, TensorSpec


def _batches(sizes=(4, 4, 2)):
    start = 0
    out = []
    for size in sizes:
        x = torch.arange(start, start + size, dtype=torch.float32).reshape(size, 1)
        out.append((x, {"label": torch.arange(start, start + size)}))
        start += size
    return out


def test_replication_modes_and_option_rules():
    assert [m.name for m in phalanx.InputReplicationMode] == ["PER_WORKER", "PER_REPLICA"]
    options = phalanx.InputOptions(experimental_replication_mode="per_replica")
    assert options.experimental_replication_mode is phalanx.InputReplicationMode.PER_REPLICA
    assert phalanx.InputOptions().experimental_place_dataset_on_device is False
    with pytest.raises(ValueError, match="must be one of \\['PER_WORKER', 'PER_REPLICA'\\]"):
        phalanx.InputOptions(experimental_replication_mode="PER_HOST")
    with pytest.raises(
        ValueError, match="needs experimental_replication_mode=InputReplicationMode.PER_REPLICA"
    ):
        phalanx.InputOptions(experimental_place_dataset_on_device=True, experimental_fetch_to_device=False)
    with pytest.raises(ValueError, match="cannot both be set"):
        phalanx.InputOptions(
            experimental_replication_mode=phalanx.InputReplicationMode.PER_REPLICA,
            experimental_place_dataset_on_device=True,
        )


def test_per_replica_mode_calls_the_function_once_per_replica(mirrored_2cpu):
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        rows = 3 if ctx.input_pipeline_id == 0 else 1  # replica 1 runs out first
        return [torch.full((2, 1), 10.0 * ctx.input_pipeline_id + step) for step in range(rows)]

    options = phalanx.InputOptions(experimental_replication_mode=phalanx.InputReplicationMode.PER_REPLICA)
    dataset = mirrored_2cpu.distribute_datasets_from_function(dataset_fn, options)
    assert [(c.num_input_pipelines, c.input_pipeline_id, c.num_replicas_in_sync) for c in contexts] == [
        (2, 0, 2),
        (2, 1, 2),
    ]
    steps = [[t[:, 0].tolist() for t in mirrored_2cpu.experimental_local_results(b)] for b in dataset]
    assert steps == [[[0.0, 0.0], [10.0, 10.0]], [[1.0, 1.0], []], [[2.0, 2.0], []]]
    total = mirrored_2cpu.run(lambda x: x.sum(), args=(next(iter(dataset)),))
    assert float(mirrored_2cpu.reduce("SUM", total, axis=None)) == 20.0


def _device_context_active() -> bool:
    return any(isinstance(mode, DeviceContext) for mode in _get_current_function_mode_stack())


@pytest.mark.parametrize("on_device", [True, False])
def test_place_dataset_on_device_makes_and_reads_the_dataset_under_the_replica_device(
    mirrored_2cpu, on_device
):
    made, read = [], []

    def dataset_fn(ctx):
        made.append(_device_context_active())

        def rows():
            for step in range(2):
                read.append(_device_context_active())
                yield torch.ones(1, 1) * step

        return rows()

    options = phalanx.InputOptions(
        experimental_replication_mode=phalanx.InputReplicationMode.PER_REPLICA,
        experimental_place_dataset_on_device=on_device,
        experimental_fetch_to_device=False,
    )
    list(mirrored_2cpu.distribute_datasets_from_function(dataset_fn, options))
    assert made == [on_device] * 2
    assert read == [on_device] * 4
    assert not _device_context_active()


def test_per_replica_mode_is_refused_by_experimental_distribute_dataset(mirrored_2cpu):
    options = phalanx.InputOptions(experimental_replication_mode="PER_REPLICA")
    with pytest.raises(ValueError, match="PER_REPLICA works with distribute_datasets_from_function only"):
        mirrored_2cpu.experimental_distribute_dataset(_batches(), options)


def test_element_spec_of_datasets_and_iterators(mirrored_2cpu, one_device):
    expected = (TensorSpec((None, 1), torch.float32), {"label": TensorSpec((None,), torch.int64)})
    single = one_device.experimental_distribute_dataset(_batches())
    assert single.element_spec == expected
    assert iter(single).element_spec == expected
    dataset = mirrored_2cpu.experimental_distribute_dataset(_batches())
    assert dataset.element_spec == PerReplicaSpec((expected, expected))
    iterator = iter(dataset)
    next(iterator)
    assert iterator.element_spec == dataset.element_spec
    from_fn = mirrored_2cpu.distribute_datasets_from_function(
        lambda ctx: [(torch.ones(2, 3, dtype=torch.float64),)]
    )
    assert from_fn.element_spec == PerReplicaSpec(((TensorSpec((None, 3), torch.float64),),) * 2)
    assert expected[0].is_compatible_with(torch.zeros(5, 1))
    assert not expected[0].is_compatible_with(torch.zeros(5, 2))
    assert not expected[0].is_compatible_with(torch.zeros(5, 1, dtype=torch.float64))


def test_element_spec_errors(one_device):
    with pytest.raises(ValueError, match="empty dataset is unknown"):
        one_device.experimental_distribute_dataset([]).element_spec  # noqa: B018
    with pytest.raises(TypeError, match="element_spec describes tensors"):
        one_device.experimental_distribute_dataset([(torch.ones(2), object())]).element_spec  # noqa: B018
    loose = phalanx.DistributedIterator(one_device, lambda: None, phalanx.InputOptions(), agree=False)
    with pytest.raises(ValueError, match="not made by a distributed dataset"):
        loose.element_spec  # noqa: B018


def test_reduce_folds_over_every_distributed_element(mirrored_2cpu):
    dataset = mirrored_2cpu.experimental_distribute_dataset(_batches())

    def add(state, element):
        x, _ = element
        local = mirrored_2cpu.run(lambda t: t.sum(), args=(x,))
        return state + mirrored_2cpu.reduce("SUM", local, axis=None)

    assert float(dataset.reduce(torch.tensor(0.0), add)) == float(sum(range(10)))


def test_hint_shards_nothing_as_tf_does_without_a_shard_placeholder():
    two_workers = SimpleNamespace(num_workers_in_sync=2, worker_rank=1)
    source = phalanx.data.Dataset.range(8).batch(4)
    options = phalanx.data.Options()
    options.experimental_distribute.auto_shard_policy = phalanx.data.experimental.AutoShardPolicy.HINT
    dataset = DistributedDataset(two_workers, source.with_options(options))
    assert dataset._sequential  # read whole and in order, like OFF
    assert dataset._source is not None
    assert phalanx.data.experimental.AutoShardPolicy is phalanx.AutoShardPolicy
    assert phalanx.AutoShardPolicy.HINT == 3  # TF's value
