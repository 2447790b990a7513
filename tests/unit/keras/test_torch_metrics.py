"""torchmetrics metrics in compile: their own update/compute in torch's order, global values."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import phalanx
from phalanx.metrics.torch_metric import TorchMetric

torchmetrics = pytest.importorskip("torchmetrics")
from torchmetrics import classification, regression  # noqa: E402

STRATEGIES = ["one_device", "mirrored_2cpu"]


def _data(n=45):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)


def _model(strategy, metrics):
    with strategy.scope():
        torch.manual_seed(1)
        model = phalanx.Model(nn.Linear(5, 3))
        model.compile(
            optimizer=torch.optim.SGD(model.parameters(), lr=0.5), loss=nn.CrossEntropyLoss(), metrics=metrics
        )
    return model


@pytest.mark.parametrize("runner", STRATEGIES, indirect=True)
def test_multiclass_accuracy_logs_what_accuracy_logs_in_fit(runner):
    x, y = _data()
    model = _model(
        runner.strategy, ["accuracy", classification.MulticlassAccuracy(num_classes=3, average="micro")]
    )
    history = model.fit(x, y, batch_size=8, epochs=3, verbose=0, shuffle=False).history
    assert history["multiclass_accuracy"] == pytest.approx(history["accuracy"], abs=1e-6)
    assert len(set(history["accuracy"])) > 1  # the values move: the comparison is not of constants


@pytest.mark.parametrize("runner", STRATEGIES, indirect=True)
def test_a_torchmetric_s_value_is_its_value_on_the_whole_data(runner):
    x, y = _data()
    made = [classification.MulticlassF1Score(num_classes=3), regression.MeanSquaredError()]
    model = _model(runner.strategy, [made[0]])
    logs = model.evaluate(x, y, batch_size=8, return_dict=True, verbose=0)  # 45 = 5 x 8 + 5: uneven
    want = classification.MulticlassF1Score(num_classes=3)(model.predict(x, batch_size=8, verbose=0), y)
    assert logs["multiclass_f1_score"] == pytest.approx(want.item(), abs=1e-6)
    assert made[0].update_count == 0  # the user's object is a template, never updated


def test_a_float_state_metric_sums_over_replicas(mirrored_2cpu):
    pred, target = torch.randn(10, 3), torch.randn(10, 3)
    with mirrored_2cpu.scope():
        metric = phalanx.metrics.get(regression.MeanSquaredError())
    dataset = mirrored_2cpu.experimental_distribute_dataset([(target, pred)])
    for t, p in dataset:
        mirrored_2cpu.run(metric.update_state, args=(t, p))
    torch.testing.assert_close(metric.result().float(), regression.MeanSquaredError()(pred, target))


def test_get_wraps_torchmetrics_objects():
    metric = phalanx.metrics.get(classification.MulticlassAccuracy(num_classes=3))
    assert isinstance(metric, TorchMetric)
    assert metric.name == "multiclass_accuracy"


def test_a_metric_with_a_cat_state_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="reduced by dim_zero_cat .*thresholds="):
        phalanx.metrics.get(classification.BinaryAUROC())


def test_a_binned_metric_works():
    metric = TorchMetric(classification.BinaryAUROC(thresholds=11))
    pred, target = torch.rand(20), torch.randint(0, 2, (20,))
    metric.update_state(target, pred)
    torch.testing.assert_close(
        metric.result().float(), classification.BinaryAUROC(thresholds=11)(pred, target)
    )


def test_sample_weight_is_refused_with_the_fix():
    metric = TorchMetric(classification.MulticlassAccuracy(num_classes=3))
    with pytest.raises(ValueError, match="takes no sample_weight"):
        metric.update_state(torch.tensor([0]), torch.randn(1, 3), sample_weight=torch.ones(1))


def test_torch_metric_takes_only_torchmetrics():
    with pytest.raises(TypeError, match="wraps a torchmetrics.Metric"):
        TorchMetric(phalanx.metrics.Mean())


def test_a_saved_torch_metric_is_not_rebuilt_silently():
    config = TorchMetric(classification.MulticlassAccuracy(num_classes=3)).get_config()
    with pytest.raises(NotImplementedError, match="compile=False"):
        TorchMetric.from_config(config)


def test_reset_starts_the_totals_again():
    metric = TorchMetric(classification.MulticlassAccuracy(num_classes=3, average="micro"))
    metric.update_state(torch.tensor([0, 1]), torch.tensor([[1.0, 0, 0], [1.0, 0, 0]]))
    assert metric.result().item() == pytest.approx(0.5)
    metric.reset_state()
    metric.update_state(torch.tensor([0]), torch.tensor([[1.0, 0, 0]]))
    assert metric.result().item() == pytest.approx(1.0)
