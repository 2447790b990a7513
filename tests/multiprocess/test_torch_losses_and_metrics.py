"""PyTorch losses and torchmetrics metrics in Model.fit under MultiWorkerMirroredStrategy: the
same loss history as the Keras loss and as one device, metrics of the whole data."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import phalanx

pytestmark = pytest.mark.multiprocess
torchmetrics = pytest.importorskip("torchmetrics")


def _fit(strategy, loss, metrics=None):
    from torchmetrics.classification import MulticlassAccuracy

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(44, 5, generator=g), torch.randint(0, 3, (44,), generator=g)
    y[::7] = -100  # ignored targets: torch's mean divides by the counted ones of the global batch
    with strategy.scope():
        torch.manual_seed(1)
        model = phalanx.Model(nn.Linear(5, 3))
        metrics = [MulticlassAccuracy(num_classes=3, average="micro", ignore_index=-100)] if metrics else None
        model.compile(optimizer=torch.optim.SGD(model.parameters(), lr=0.5), loss=loss, metrics=metrics)
    return model.fit(x, y, batch_size=8, epochs=3, verbose=0, shuffle=False).history


def histories(strategy):
    """Module level: every worker process runs it."""
    return {
        "module": _fit(strategy, nn.CrossEntropyLoss(weight=torch.tensor([0.5, 1.0, 2.0])), metrics=True),
        "function": _fit(strategy, F.cross_entropy),
        "sum": _fit(strategy, nn.CrossEntropyLoss(reduction="sum")),
    }


def test_torch_losses_and_metrics_under_multi_worker_mirrored_equal_one_device(mwms_2workers):
    want = histories(phalanx.OneDeviceStrategy("cpu"))
    results = mwms_2workers.run(histories)
    assert len(results) == 2
    for got in results:
        for key in want:
            assert got[key]["loss"] == pytest.approx(want[key]["loss"], abs=1e-4), key
        assert got["module"]["multiclass_accuracy"] == pytest.approx(
            want["module"]["multiclass_accuracy"], abs=1e-6
        )


def test_torch_cross_entropy_equals_the_keras_loss_under_multi_worker_mirrored(mwms_2workers):
    results = mwms_2workers.run(keras_and_torch)
    for keras, torch_history in results:
        assert torch_history["loss"] == pytest.approx(keras["loss"], abs=1e-4)
        assert torch_history["multiclass_accuracy"] == pytest.approx(torch_history["accuracy"], abs=1e-6)


def keras_and_torch(strategy):
    from torchmetrics.classification import MulticlassAccuracy

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(44, 5, generator=g), torch.randint(0, 3, (44,), generator=g)
    out = []
    for loss, metrics in (
        (phalanx.losses.SparseCategoricalCrossentropy(from_logits=True), ["accuracy"]),
        (nn.CrossEntropyLoss(), ["accuracy", MulticlassAccuracy(num_classes=3, average="micro")]),
    ):
        with strategy.scope():
            torch.manual_seed(1)
            model = phalanx.Model(nn.Linear(5, 3))
            model.compile(optimizer=torch.optim.SGD(model.parameters(), lr=0.5), loss=loss, metrics=metrics)
        out.append(model.fit(x, y, batch_size=8, epochs=3, verbose=0, shuffle=False).history)
    return tuple(out)


_kept = []


def one_worker_keeps_a_dead_model(strategy):
    """Worker 0 keeps the first model (as a garbage collector that has not run yet would),
    worker 1 frees it; then both train a second one. Reading the kept model's metric states
    before each step (a cross-worker aggregate) gave worker 0 collectives worker 1 never
    joined."""
    import gc

    x, y = torch.randn(16, 5), torch.randint(0, 3, (16,))
    with strategy.scope():
        first = phalanx.Model(nn.Linear(5, 3))
        first.compile(optimizer="sgd", loss=nn.CrossEntropyLoss(), metrics=["accuracy"])
    first.fit(x, y, batch_size=8, epochs=1, verbose=0)
    if strategy.cluster_resolver.task_id == 0:
        _kept.append(first)
    del first
    gc.collect()
    with strategy.scope():
        second = phalanx.Model(nn.Linear(5, 3))
        second.compile(optimizer="sgd", loss=nn.CrossEntropyLoss(), metrics=["accuracy"])
    return second.fit(x, y, batch_size=8, epochs=2, verbose=0).history["loss"]


def test_a_model_alive_on_one_worker_only_does_not_change_the_collectives(mwms_2workers):
    first, second = mwms_2workers.run(one_worker_keeps_a_dead_model)
    assert first == pytest.approx(second)
