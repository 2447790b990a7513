"""phalanx.losses and phalanx.metrics: Keras numbers, count-weighted aggregation, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import phalanx
from phalanx import losses as L
from phalanx import metrics as M


def test_losses_match_torch_and_reduce_like_keras():
    logits = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 1, 2, 3, 0, 1])
    per = L.SparseCategoricalCrossentropy(from_logits=True, reduction="none")(y, logits)
    torch.testing.assert_close(per, torch.nn.functional.cross_entropy(logits, y, reduction="none"))
    probs = logits.softmax(-1)
    sparse = L.SparseCategoricalCrossentropy()(y, probs)
    onehot = L.CategoricalCrossentropy()(torch.nn.functional.one_hot(y, 4), probs)
    torch.testing.assert_close(sparse, onehot)
    assert L.get("mse")(torch.ones(2, 3), torch.zeros(2, 3)).item() == 1.0
    assert L.get("mae")(torch.ones(2), torch.zeros(2), sample_weight=torch.tensor([1.0, 0.0])).item() == 0.5
    assert L.MeanSquaredError(reduction="sum")(torch.ones(4), torch.zeros(4)).item() == 4.0
    bce = L.BinaryCrossentropy(from_logits=True)(torch.tensor([1.0, 0.0]), torch.tensor([0.3, -0.2]))
    expected = torch.nn.functional.binary_cross_entropy_with_logits(
        torch.tensor([0.3, -0.2]), torch.tensor([1.0, 0.0])
    )
    torch.testing.assert_close(bce, expected)
    assert L.get("huber")(torch.zeros(1), torch.tensor([3.0])).item() == pytest.approx(2.5)
    assert L.get("MeanSquaredError").name == "mean_squared_error"
    assert L.SparseCategoricalCrossentropy(from_logits=True)(y[:0], logits[:0]).item() == 0.0  # empty batch
    ignored = L.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0, reduction="none")(y, logits)
    assert ignored[0].item() == 0.0


def test_loss_config_round_trip_and_callables():
    loss = L.SparseCategoricalCrossentropy(from_logits=True)
    again = L.SparseCategoricalCrossentropy.from_config(loss.get_config())
    assert again.get_config() == loss.get_config()
    wrapped = L.get(lambda t, p: (t - p) ** 2)
    assert wrapped(torch.ones(3), torch.zeros(3)).item() == 1.0


def test_loss_errors():
    with pytest.raises(ValueError, match="Unknown loss"):
        L.get("nope")
    with pytest.raises(ValueError, match="reduction must be one of"):
        L.MeanSquaredError(reduction="avg")
    with pytest.raises(ValueError, match="returned a scalar"):
        L.get(lambda t, p: ((t - p) ** 2).mean())(torch.ones(3), torch.zeros(3))
    with pytest.raises(ValueError, match="must be a name"):
        L.get(3)


def test_metrics_values():
    acc = M.get("accuracy", loss="sparse_categorical_crossentropy")
    assert isinstance(acc, M.SparseCategoricalAccuracy)
    assert acc.name == "accuracy"
    acc.update_state(torch.tensor([0, 1]), torch.tensor([[0.9, 0.1], [0.8, 0.2]]))
    assert acc.result().item() == 0.5
    assert isinstance(M.get("accuracy", loss=L.BinaryCrossentropy()), M.BinaryAccuracy)
    assert isinstance(M.get("acc"), M.Accuracy)
    mse = M.get("mse")
    mse.update_state(torch.zeros(2, 2), torch.ones(2, 2))
    assert mse.result().item() == 1.0
    rmse = M.RootMeanSquaredError()
    rmse.update_state(torch.zeros(2), torch.full((2,), 2.0))
    assert rmse.result().item() == 2.0
    mean = M.Mean()
    assert mean.result().item() == 0.0  # empty: 0, not NaN
    mean.update_state(torch.tensor([1.0, 3.0]), sample_weight=torch.tensor([1.0, 3.0]))
    assert mean.result().item() == 2.5
    total = M.Sum()
    total.update_state(torch.tensor([1.0, 2.0]))
    assert total(torch.tensor(3.0)).item() == 6.0
    topk = M.SparseTopKCategoricalAccuracy(k=2)
    topk.update_state(torch.tensor([2]), torch.tensor([[0.1, 0.5, 0.4]]))
    assert topk.result().item() == 1.0


def test_precision_recall_auc():
    from sklearn.metrics import precision_score, recall_score, roc_auc_score

    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 300)
    p = np.clip(y * 0.35 + rng.random(300) * 0.65, 0, 1)
    precision, recall, auc = M.Precision(), M.Recall(), M.AUC(num_thresholds=500)
    for m in (precision, recall, auc):
        m.update_state(torch.tensor(y), torch.tensor(p))
    assert precision.result().item() == pytest.approx(precision_score(y, p > 0.5))
    assert recall.result().item() == pytest.approx(recall_score(y, p > 0.5))
    assert auc.result().item() == pytest.approx(roc_auc_score(y, p), abs=1e-2)
    pr = M.AUC(curve="PR")
    pr.update_state(torch.tensor(y), torch.tensor(p))
    assert 0.5 < pr.result().item() <= 1.0
    logits = M.AUC(from_logits=True)
    logits.update_state(torch.tensor(y), torch.logit(torch.tensor(p).clamp(1e-6, 1 - 1e-6)))
    assert logits.result().item() == pytest.approx(auc.result().item(), abs=1e-2)


def test_metric_errors():
    with pytest.raises(ValueError, match="Unknown metric"):
        M.get("nope")
    with pytest.raises(ValueError, match="must be a name"):
        M.get(3)
    with pytest.raises(ValueError, match="num_thresholds must be > 1"):
        M.AUC(num_thresholds=1)
    with pytest.raises(ValueError, match="curve must be"):
        M.AUC(curve="XY")
    with pytest.raises(ValueError, match="thresholds must be in"):
        M.Precision(thresholds=2.0)
    with pytest.raises(ValueError, match="must start at zeros"):
        M.Mean().add_state("x", initializer="ones")


@pytest.mark.parametrize("replicas", [2, 4])
def test_metric_over_replicas_equals_single_device(replicas):
    strategy = phalanx.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])
    y = torch.zeros(25, dtype=torch.long)
    pred = torch.zeros(25, 3)
    pred[0, 0] = 1.0
    pred[1:, 1] = 1.0
    with strategy.scope():
        acc = M.SparseCategoricalAccuracy()
        auc = M.AUC()
    for batch in strategy.experimental_distribute_dataset([(y, pred)]):
        strategy.run(lambda t, p: (acc.update_state(t, p), auc.update_state(t == 0, p[:, 0])), args=batch)
    assert acc.result().item() == pytest.approx(0.04)  # 1 of 25, not the mean of replica accuracies
    single = M.AUC()
    single.update_state(y == 0, pred[:, 0])
    assert auc.result().item() == pytest.approx(single.result().item())
    acc.reset_state()
    assert acc.result().item() == 0.0
    strategy._threads.close()
