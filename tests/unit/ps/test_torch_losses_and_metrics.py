"""PyTorch losses and torchmetrics metrics in Model.fit under ParameterServerStrategy."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import phalanx

torchmetrics = pytest.importorskip("torchmetrics")
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score  # noqa: E402


def _fit(strategy, loss, metrics):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(90, 4, generator=g), torch.randint(0, 3, (90,), generator=g)
    with strategy.scope():
        torch.manual_seed(0)
        model = phalanx.Model(nn.Linear(4, 3))
        # lr=0: the weights stay, so the asynchronous steps on two workers give fixed values
        model.compile(optimizer=torch.optim.SGD(model.parameters(), lr=0.0), loss=loss, metrics=metrics)
    history = model.fit(x, y, batch_size=20, epochs=2, verbose=0).history
    with torch.no_grad():
        logits = model.module(x)
    return history, logits, y


def test_torch_losses_and_metrics_give_the_values_of_the_whole_data(ps_2workers_1ps):
    strategy = ps_2workers_1ps.strategy()
    metrics = [
        "accuracy",
        MulticlassAccuracy(num_classes=3, average="micro"),
        MulticlassF1Score(num_classes=3),
    ]
    torch_history, logits, y = _fit(strategy, nn.CrossEntropyLoss(), metrics)
    keras_history, _, _ = _fit(
        strategy, phalanx.losses.SparseCategoricalCrossentropy(from_logits=True), ["accuracy"]
    )
    assert torch_history["loss"] == pytest.approx(keras_history["loss"], abs=1e-4)
    assert torch_history["loss"][0] == pytest.approx(nn.functional.cross_entropy(logits, y).item(), abs=1e-4)
    assert torch_history["multiclass_accuracy"] == pytest.approx(torch_history["accuracy"], abs=1e-6)
    f1 = MulticlassF1Score(num_classes=3)(logits, y).item()
    assert torch_history["multiclass_f1_score"] == pytest.approx([f1, f1], abs=1e-6)
