"""Distributed input (TF's split rule) and compute_average_loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import phalanx
from phalanx.input.splitting import split_sizes


def test_split_sizes_follow_tf():
    assert split_sizes(32, 2) == [16, 16]
    assert split_sizes(25, 2) == [13, 12]
    assert split_sizes(26, 2) == [13, 13]
    assert split_sizes(1, 2) == [1, 0]
    assert split_sizes(5, 4) == [2, 1, 1, 1]
    with pytest.raises(ValueError, match="num_parts must be >= 1"):
        split_sizes(3, 0)


@pytest.mark.parametrize(
    "source",
    ["list", "dataloader", "dataset", "numpy_dicts"],
)
def test_sources_are_split_contiguously(mirrored_2cpu, source):
    x = torch.arange(10.0).reshape(5, 2)
    y = torch.arange(5)
    if source == "list":
        data = [(x, y)]
    elif source == "dataloader":
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=5)
    elif source == "dataset":
        data = phalanx.data.Dataset.from_tensor_slices((x, y)).batch(5)
    else:
        data = [{"x": x.numpy(), "y": y.numpy()}]
    batch = next(iter(mirrored_2cpu.experimental_distribute_dataset(data)))
    ys = batch["y"] if isinstance(batch, dict) else batch[1]
    assert [t.tolist() for t in mirrored_2cpu.experimental_local_results(ys)] == [[0, 1, 2], [3, 4]]


def test_empty_replica_batch_still_completes_the_step(mirrored_2cpu):
    with mirrored_2cpu.scope():
        layer = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    before = layer.weight.detach().clone()

    def step(x):
        loss = phalanx.compute_average_loss(layer(x).squeeze(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    (x,) = next(iter(mirrored_2cpu.experimental_distribute_dataset([(torch.ones(1, 2),)])))
    losses = mirrored_2cpu.experimental_local_results(mirrored_2cpu.run(step, args=(x,)))
    assert losses[1].item() == 0.0
    torch.testing.assert_close(layer.weight, before - 0.1)  # the one example's gradient, counted once


def test_iterator_protocol_and_optional(one_device):
    dist = one_device.experimental_distribute_dataset([torch.ones(2, 1)] * 2)
    it = iter(dist)
    assert it.get_next().shape == (2, 1)
    assert it.get_next_as_optional().has_value()
    empty = it.get_next_as_optional()
    assert not empty.has_value()
    with pytest.raises(ValueError, match="no value"):
        empty.get_value()
    assert len(dist) == 2
    with pytest.raises(TypeError, match="iterable of batches"):
        one_device.experimental_distribute_dataset(3)


def test_distribute_datasets_from_function(mirrored_2cpu):
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        return [torch.full((ctx.get_per_replica_batch_size(8), 1), float(i)) for i in range(3)]

    steps = list(mirrored_2cpu.distribute_datasets_from_function(dataset_fn))
    assert contexts[0] == phalanx.InputContext(1, 0, 2)
    assert len(steps) == 2  # two batches per step, the last step has one plus an empty one
    assert [t.shape[0] for t in mirrored_2cpu.experimental_local_results(steps[1])] == [4, 0]
    with pytest.raises(TypeError, match="needs a callable"):
        mirrored_2cpu.distribute_datasets_from_function(3)


def test_input_options_and_context_validation():
    with pytest.raises(ValueError, match="divisible by num_replicas_in_sync"):
        phalanx.InputContext(1, 0, 2).get_per_replica_batch_size(33)
    with pytest.raises(ValueError, match="input_pipeline_id must be in"):
        phalanx.InputContext(2, 2, 2)
    with pytest.raises(ValueError, match="num_input_pipelines must be >= 1"):
        phalanx.InputContext(0, 0, 1)
    with pytest.raises(ValueError, match="num_replicas_in_sync must be >= 1"):
        phalanx.InputContext(1, 0, 0)
    with pytest.raises(ValueError, match="buffer_size must be >= 0"):
        phalanx.InputOptions(experimental_per_replica_buffer_size=-1)
    with pytest.raises(ValueError, match="PER_WORKER"):
        phalanx.InputOptions(experimental_replication_mode="PER_REPLICA")
    assert phalanx.AutoShardPolicy.coerce("file") is phalanx.AutoShardPolicy.FILE
    assert phalanx.AutoShardPolicy.coerce(-1) is phalanx.AutoShardPolicy.OFF
    with pytest.raises(ValueError, match="auto_shard_policy must be one of"):
        phalanx.AutoShardPolicy.coerce(7)


def test_bad_batches_are_rejected(mirrored_2cpu):
    with pytest.raises(ValueError, match="same first dimension"):
        next(iter(mirrored_2cpu.experimental_distribute_dataset([(torch.ones(2), torch.ones(3))])))
    with pytest.raises(ValueError, match="batch dimension"):
        next(iter(mirrored_2cpu.experimental_distribute_dataset([torch.tensor(1.0)])))
    with pytest.raises(ValueError, match="at least one tensor"):
        next(iter(mirrored_2cpu.experimental_distribute_dataset([("a", "b")])))


def test_compute_average_loss_cases(mirrored_2cpu):
    per_example = torch.tensor([1.0, 2.0, 3.0])
    assert phalanx.compute_average_loss(per_example).item() == 2.0  # default strategy: local batch
    assert phalanx.compute_average_loss(per_example, global_batch_size=6).item() == 1.0
    weighted = phalanx.compute_average_loss(
        torch.ones(2, 3), sample_weight=torch.tensor([1.0, 0.0]), global_batch_size=2
    )
    assert weighted.item() == 1.5
    empty = phalanx.compute_average_loss(torch.zeros(0, requires_grad=True))
    assert empty.item() == 0.0
    assert empty.requires_grad
    assert phalanx.compute_average_loss(np.array([2.0, 4.0]), global_batch_size=4).item() == 1.5
    # TF's fallback rule without distributed input: local size x replicas
    values = mirrored_2cpu.run(lambda: phalanx.compute_average_loss(torch.tensor([2.0, 2.0])))
    assert [v.item() for v in mirrored_2cpu.experimental_local_results(values)] == [1.0, 1.0]
    reg = mirrored_2cpu.run(lambda: phalanx.scale_regularization_loss(torch.tensor([1.0, 3.0])))
    assert mirrored_2cpu.experimental_local_results(reg)[0].item() == 2.0
    with pytest.raises(ValueError, match="rank >= 1"):
        phalanx.compute_average_loss(torch.tensor(1.0))
    with pytest.raises(ValueError, match="positive integer"):
        phalanx.compute_average_loss(per_example, global_batch_size=0)
    with pytest.raises(ValueError, match="positive integer"):
        phalanx.compute_average_loss(per_example, global_batch_size=2.5)
    with mirrored_2cpu.scope():
        with pytest.raises(RuntimeError, match="cross-replica context without a global_batch_size"):
            phalanx.compute_average_loss(per_example)
        with pytest.raises(RuntimeError, match="scale_regularization_loss was called in cross-replica"):
            phalanx.scale_regularization_loss(per_example)


def test_interleaved_iterators_each_give_run_their_own_global_batch_size(any_strategy):
    def mean_of_ones(x):
        return phalanx.compute_average_loss(torch.ones(x.shape[0]))

    big = iter(any_strategy.experimental_distribute_dataset([torch.zeros(8, 1)] * 2))
    small = iter(any_strategy.experimental_distribute_dataset([torch.zeros(3, 1)] * 2))
    a, b = next(big), next(small)  # b handed out last, a given to run first
    for batch in (a, b):
        out = any_strategy.run(mean_of_ones, args=(batch,))
        assert any_strategy.reduce("sum", out, axis=None).item() == pytest.approx(1.0)
