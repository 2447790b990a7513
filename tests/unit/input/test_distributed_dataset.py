"""Distributed datasets and iterators: splitting global batches across replicas."""

from __future__ import annotations

import pytest
import torch

import phalanx


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


def test_bad_batches_are_rejected(mirrored_2cpu):
    with pytest.raises(ValueError, match="same first dimension"):
        next(iter(mirrored_2cpu.experimental_distribute_dataset([(torch.ones(2), torch.ones(3))])))
    with pytest.raises(ValueError, match="batch dimension"):
        next(iter(mirrored_2cpu.experimental_distribute_dataset([torch.tensor(1.0)])))
    with pytest.raises(ValueError, match="at least one tensor"):
        next(iter(mirrored_2cpu.experimental_distribute_dataset([("a", "b")])))


@pytest.mark.parametrize(
    "batch",
    [
        (torch.ones(2, 1), torch.ones(3)),
        (torch.ones(2, 1), torch.tensor(1.0)),
        (torch.ones(2), None, torch.ones(1)),
    ],
)
def test_bad_tuple_batches_are_rejected_by_one_replica_too(any_strategy, batch):
    # the usual (x, y[, None]) batch takes a short path: it refuses what the full walk refuses
    with pytest.raises(ValueError, match="same first dimension|batch dimension"):
        next(iter(any_strategy.experimental_distribute_dataset([batch])))


def test_the_usual_batch_reaches_one_replica_as_the_same_tensors(one_device):
    x, y = torch.ones(4, 2), torch.zeros(4)
    for batch in ((x, y), (x, y, None)):
        [given] = list(one_device.experimental_distribute_dataset([batch]))
        assert type(given) is tuple  # no copy, no rebuilt structure
        assert len(given) == len(batch)
        assert all(a is b for a, b in zip(given, batch, strict=True))


def test_interleaved_iterators_each_give_run_their_own_global_batch_size(any_strategy):
    def mean_of_ones(x):
        return phalanx.compute_average_loss(torch.ones(x.shape[0]))

    big = iter(any_strategy.experimental_distribute_dataset([torch.zeros(8, 1)] * 2))
    small = iter(any_strategy.experimental_distribute_dataset([torch.zeros(3, 1)] * 2))
    a, b = next(big), next(small)  # b handed out last, a given to run first
    for batch in (a, b):
        out = any_strategy.run(mean_of_ones, args=(batch,))
        assert any_strategy.reduce("sum", out, axis=None).item() == pytest.approx(1.0)


def test_a_data_sharded_iterator_tells_the_transport_whether_a_step_follows(mirrored_2cpu, monkeypatch):
    # MultiWorkerMirrored over gloo: the flag rides with the step's gradients, so no pass is
    # announced ahead after the last step (what follows the loop needs no zeros)
    told: list[bool] = []
    monkeypatch.setattr(
        mirrored_2cpu, "_carry_data_flag", lambda has: told.append(has) or object(), raising=False
    )
    batches = [torch.full((2, 1), float(i)) for i in range(3)]
    seen = [b.values[0] for b in mirrored_2cpu.experimental_distribute_dataset(batches)]
    assert [float(x[0, 0]) for x in seen] == [0.0, 1.0, 2.0]  # each batch once, in order
    assert told == [True, True, False]
    told.clear()
    monkeypatch.setattr(mirrored_2cpu, "_carry_data_flag", lambda has: told.append(has), raising=False)
    assert len(list(mirrored_2cpu.experimental_distribute_dataset(batches))) == 3
    assert told == [True]  # nothing carries it: not asked again
