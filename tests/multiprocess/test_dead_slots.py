"""Model after model under one MultiWorkerMirroredStrategy: the gradient layouts forget a
dropped model's parameters once every worker has dropped them, on both paths:
buckets (one replica per worker) and end-of-backward rounds (two replicas per worker).
Before, every later step all-reduced the dead parameters' zeros, for the life of the process.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import phalanx

pytestmark = pytest.mark.multiprocess


def _train(strategy: phalanx.Strategy, width: int) -> list[float]:
    with strategy.scope():
        torch.manual_seed(width)
        model = nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.arange(16.0).reshape(4, 4) / 16

    def step() -> torch.Tensor:
        ctx = phalanx.get_replica_context()
        share = x[ctx.replica_id_in_sync_group :: ctx.num_replicas_in_sync]
        loss = model(share).pow(2).sum() / len(x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    for _ in range(2):
        strategy.run(step)
    return [float(p.detach().sum()) for p in model.parameters()]


def _slots(strategy: phalanx.Strategy) -> tuple[int, int]:
    """(tracked slots, of which dead) of the path this strategy sums gradients on."""
    buckets = strategy._buckets
    if buckets is not None:
        params = [p for b in buckets.buckets for p in b]
        return len(params), sum(p.device.type == "meta" for p in params)
    refs = strategy._gradient_sync._rounds._vars
    return len(refs), sum(ref() is None for ref in refs)


def models_one_after_another(strategy: phalanx.Strategy) -> list[tuple[int, int]]:
    seen = []
    for width in (8, 6, 5):
        _train(strategy, width)
        gc.collect()
        seen.append(_slots(strategy))
    return seen


def one_model(strategy: phalanx.Strategy, width: int) -> list[float]:
    return _train(strategy, width)


@pytest.mark.parametrize("devices", [["cpu:0"], ["cpu:0", "cpu:1"]], ids=["buckets", "rounds"])
def test_a_dropped_model_leaves_the_gradient_layout_on_every_worker(mwms_2workers, devices):
    kwargs = {"devices": devices}
    results = mwms_2workers.run(models_one_after_another, strategy_kwargs=kwargs)
    for seen in results:
        # each model has 4 parameters; an earlier model's are forgotten once the next one is
        # tracked (the buckets: at its first round), so only the last model's slots remain
        # (before: 4, 8, 12 slots, the dead ones all-reduced as zeros at every step)
        assert [slots for slots, _ in seen] == [4, 4, 4], seen
    assert results[0] == results[1]  # the same layout on both workers


def test_later_models_train_as_they_would_alone(mwms_2workers):
    # the weights of the third model after two others equal those of the same model alone
    after = mwms_2workers.run(models_then_last, strategy_kwargs={"devices": ["cpu:0", "cpu:1"]})
    alone = mwms_2workers.run(one_model, 5, strategy_kwargs={"devices": ["cpu:0", "cpu:1"]})
    for got, want in zip(after, alone, strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=0)


def models_then_last(strategy: phalanx.Strategy) -> list[float]:
    _train(strategy, 8)
    _train(strategy, 6)
    gc.collect()
    return _train(strategy, 5)
