"""Distributed variables and optimizers created in a scope."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import phalanx
from phalanx.variables import set_aggregation


def test_modules_in_scope_become_distributed_and_work(mirrored_2cpu):
    with mirrored_2cpu.scope():
        conv, bn, emb, lstm = nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Embedding(5, 3), nn.LSTM(3, 4)
    assert isinstance(conv.weight, phalanx.MirroredVariable)
    assert isinstance(conv.weight, nn.Parameter)
    assert isinstance(bn.running_mean, phalanx.SyncOnReadVariable)
    assert bn.running_mean._aggregation is phalanx.VariableAggregation.MEAN
    assert bn.num_batches_tracked._aggregation is phalanx.VariableAggregation.ONLY_FIRST_REPLICA

    def fn():
        y = bn(conv(torch.randn(2, 1, 5, 5)))
        out, _ = lstm(emb(torch.tensor([[1, 2]])))
        return y.shape, out.shape

    shapes = mirrored_2cpu.experimental_local_results(mirrored_2cpu.run(fn))
    assert shapes[0] == (torch.Size([2, 2, 3, 3]), torch.Size([1, 2, 4]))
    # components were made from the initialised primary
    for p in list(conv.parameters()) + list(lstm.parameters()):
        torch.testing.assert_close(p.components[1], p.components[0])


def test_cross_replica_writes_are_mirrored_before_the_next_step(mirrored_2cpu):
    with mirrored_2cpu.scope():
        layer = nn.Linear(2, 2)
    mirrored_2cpu.run(lambda: None)
    layer.load_state_dict({"weight": torch.ones(2, 2), "bias": torch.zeros(2)})
    with torch.no_grad():
        nn.init.constant_(layer.bias, 3.0)
    out = mirrored_2cpu.run(lambda: layer(torch.ones(1, 2)))
    for value in mirrored_2cpu.experimental_local_results(out):
        torch.testing.assert_close(value, torch.full((1, 2), 5.0))
    state = layer.state_dict()
    assert all(type(v) is torch.Tensor for v in state.values())
    plain = nn.Linear(2, 2)
    plain.load_state_dict(state)
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    assert type(copy.deepcopy(layer).weight) is nn.Parameter


def test_sync_on_read_aggregates_and_sum_write_rule(mirrored_2cpu):
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("total", set_aggregation(torch.zeros(()), "sum"))

    with mirrored_2cpu.scope():
        counter = Counter()
    mirrored_2cpu.run(lambda: counter.total.add_(phalanx.get_replica_context().replica_id_in_sync_group + 1))
    assert counter.total.item() == 3.0
    counter.total.fill_(10.0)  # cross-replica write of a SUM variable: the total becomes 10
    assert counter.total.item() == 10.0
    assert [c.item() for c in counter.total.components] == [10.0, 0.0]


def test_replica_write_needs_an_aggregation(mirrored_2cpu):
    with mirrored_2cpu.scope():
        plain = nn.Linear(1, 1)
        holder = nn.Module()
        holder.w = set_aggregation(nn.Parameter(torch.zeros(1)), "mean")
    with pytest.raises(RuntimeError, match="needs an aggregation"):
        mirrored_2cpu.run(lambda: plain.bias.add_(1.0))

    def write():
        rid = phalanx.get_replica_context().replica_id_in_sync_group
        with torch.no_grad():
            holder.w.copy_(torch.tensor([float(rid) * 2]))

    mirrored_2cpu.run(write)
    assert [c.item() for c in holder.w.components] == [1.0, 1.0]
    with pytest.raises(NotImplementedError, match="supports only"):
        mirrored_2cpu.run(lambda: holder.w.mul_(2))


def test_optimizer_state_is_per_replica_and_plain_outside(mirrored_2cpu):
    with mirrored_2cpu.scope():
        layer = nn.Linear(2, 1)
        optimizer = torch.optim.Adam(layer.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    def step():
        layer(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(3):
        mirrored_2cpu.run(step)
        scheduler.step()
    state = optimizer.state_dict()
    assert state["state"][0]["step"].item() == 3.0  # not 6: each replica counts its own steps
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.0125)
    plain = torch.optim.Adam(nn.Linear(2, 1).parameters())
    plain.load_state_dict(state)
    optimizer.load_state_dict(state)  # loading in scope reaches every replica at the next step
    mirrored_2cpu.run(step)
    assert optimizer.state.replica_state(1)[layer.weight]["step"].item() == 4.0


def test_parameter_created_outside_the_scope_is_rejected(mirrored_2cpu):
    outside = nn.Linear(2, 1)
    with mirrored_2cpu.scope():
        optimizer = torch.optim.SGD(outside.parameters(), lr=0.1)

    def step():
        outside(torch.ones(1, 2)).sum().backward()
        optimizer.step()

    with pytest.raises(RuntimeError, match="not created in this strategy's scope"):
        mirrored_2cpu.run(step)


def test_one_device_places_parameters_and_buffers():
    strategy = phalanx.OneDeviceStrategy("cpu")
    with strategy.scope():
        bn = nn.BatchNorm1d(2)
    assert type(bn.weight) is nn.Parameter
    assert bn.running_mean.device.type == "cpu"


def test_cross_replica_grad_data_and_init_writes_reach_every_replica(mirrored_2cpu):
    with mirrored_2cpu.scope():
        layer = nn.Linear(2, 2)
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    mirrored_2cpu.run(lambda: layer(torch.ones(1, 2)).sum().backward())
    optimizer.zero_grad()  # outside run: every replica's gradient is cleared
    assert all(c.grad is None for c in layer.weight.components)
    layer.weight.data.copy_(torch.full((2, 2), 2.0))  # through .data
    torch.nn.init.constant_(layer.bias, 1.0)  # torch.nn.init passes tensor= as a keyword
    out = mirrored_2cpu.run(lambda: layer(torch.ones(1, 2)))
    for value in mirrored_2cpu.experimental_local_results(out):
        torch.testing.assert_close(value, torch.full((1, 2), 5.0))
    layer.weight.requires_grad = False
    assert not any(c.requires_grad for c in layer.weight.components)
