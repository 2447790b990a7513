"""phalanx.variables.Variable (tf.Variable): a variable outside any module, distributed by
the strategy whose scope creates it (a bare variable made in a scope)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import phalanx
from phalanx.variables import (
    MirroredVariable,
    SyncOnReadVariable,
    Variable,
    VariableAggregation,
)


def _trained(strategy: phalanx.Strategy) -> torch.Tensor:
    with strategy.scope():
        weight = Variable(torch.zeros(3))
        optimizer = torch.optim.SGD([weight], lr=0.5)

    def step(x: torch.Tensor) -> None:
        losses = (x @ weight - 1.0) ** 2
        phalanx.compute_average_loss(losses, global_batch_size=4).backward()
        optimizer.step()
        optimizer.zero_grad()

    x = torch.arange(12.0).reshape(4, 3) / 10
    for batch in strategy.experimental_distribute_dataset([x, x]):
        strategy.run(step, args=(batch,))
    with strategy.scope():
        return weight.detach().clone()


def test_a_trainable_variable_trains_like_one_device(mirrored_2cpu, central_storage_2cpu):
    expected = _trained(phalanx.OneDeviceStrategy("cpu"))
    for strategy in (mirrored_2cpu, central_storage_2cpu):
        torch.testing.assert_close(_trained(strategy), expected, rtol=1e-6, atol=1e-7)


def test_kinds_in_a_mirrored_scope(mirrored_2cpu):
    with mirrored_2cpu.scope():
        trainable = Variable([1.0, 2.0], dtype=torch.float64)
        counter = Variable(0, trainable=False)
        total = Variable(torch.zeros(()), trainable=False, synchronization="on_read", aggregation="sum")
    assert type(trainable) is MirroredVariable
    assert trainable._is_param
    assert trainable.requires_grad
    assert trainable.dtype == torch.float64
    assert type(counter) is MirroredVariable  # TF: non-trainable variables are mirrored on write
    assert not counter._is_param
    assert type(total) is SyncOnReadVariable
    assert total.aggregation is VariableAggregation.SUM


def test_outside_a_scope_a_plain_parameter_or_tensor():
    initial = torch.ones(2)
    trainable, fixed = Variable(initial), Variable(initial, trainable=False)
    assert type(trainable) is nn.Parameter
    assert type(fixed) is torch.Tensor
    assert not fixed.requires_grad
    initial.add_(1.0)  # copied
    torch.testing.assert_close(trainable.detach(), torch.ones(2))


def test_inside_run_is_refused(mirrored_2cpu):
    with pytest.raises(RuntimeError, match=r"created in the strategy's scope, once.*inside MirroredStrategy"):
        mirrored_2cpu.run(lambda: Variable(torch.zeros(1)))


@pytest.mark.parametrize("runner", ["mwms_2workers"], indirect=True)
def test_a_trainable_variable_trains_like_one_device_across_workers(runner):
    expected = _trained(phalanx.OneDeviceStrategy("cpu"))
    for weight in runner.run(_trained):
        torch.testing.assert_close(weight, expected, rtol=1e-6, atol=1e-7)


def test_phalanx_variable_is_tf_variable_spelling():
    strategy = phalanx.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        v = phalanx.Variable(torch.ones(3))
    assert isinstance(v, phalanx.MirroredVariable)
    assert phalanx.Variable is phalanx.variables.Variable
