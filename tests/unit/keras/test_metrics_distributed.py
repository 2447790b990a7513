"""Metrics under an in-process strategy: SUM sync-on-read totals give count-weighted global values."""

from __future__ import annotations

import pytest
import torch

import phalanx
from phalanx import metrics as M


@pytest.fixture(params=[2, 4], ids=lambda n: f"mirrored_{n}cpu")
def strategy(request):
    strategy = phalanx.MirroredStrategy([f"cpu:{i}" for i in range(request.param)])
    yield strategy
    strategy._threads.close()


def _batch():
    y = torch.zeros(25, dtype=torch.long)
    pred = torch.zeros(25, 3)
    pred[0, 0] = 1.0  # 1 correct of 25
    pred[1:, 1] = 1.0
    return y, pred


def test_accuracy_and_auc_over_replicas_equal_one_device(strategy):
    y, pred = _batch()
    with strategy.scope():
        accuracy = M.SparseCategoricalAccuracy()
        auc = M.AUC()
        rmse = M.RootMeanSquaredError()

    def step(t, p):
        accuracy.update_state(t, p)
        auc.update_state(t == 0, p[:, 0])
        rmse.update_state(t.float(), p[:, 1])

    for batch in strategy.experimental_distribute_dataset([(y, pred)]):
        strategy.run(step, args=batch)
    assert accuracy.result().item() == pytest.approx(0.04)  # not the mean of the replicas' ratios
    single_auc, single_rmse = M.AUC(), M.RootMeanSquaredError()
    single_auc.update_state(y == 0, pred[:, 0])
    single_rmse.update_state(y.float(), pred[:, 1])
    assert auc.result().item() == pytest.approx(single_auc.result().item())
    assert rmse.result().item() == pytest.approx(single_rmse.result().item())
    accuracy.reset_state()
    assert accuracy.result().item() == 0.0
