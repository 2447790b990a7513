"""Test doubles for callbacks: a tiny model with the interface callbacks rely on, and a fit loop.

The real `phalanx.Model` is tested elsewhere; callbacks only need ``stop_training``,
``optimizer``, ``strategy``, ``state_dict``/``load_state_dict``, ``save`` and ``save_weights``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from phalanx import callbacks as C


class FakeModel(nn.Module):
    """A real module (one Linear) with Keras' model attributes; saves with torch.save."""

    def __init__(self, strategy=None, lr=0.1, metrics=()):
        super().__init__()
        self.linear = nn.Linear(2, 1)
        self.stop_training = False
        self.optimizer = torch.optim.SGD(self.parameters(), lr=lr)
        self.strategy = strategy
        self.metrics = list(metrics)
        self.history = None
        self.saved: list[tuple[str, str]] = []

    def save(self, path):
        self.saved.append(("model", path))
        torch.save({"format": "fake", "weights": self.state_dict()}, path)

    def save_weights(self, path):
        self.saved.append(("weights", path))
        torch.save(self.state_dict(), path)


def strategy(is_chief=True, task_id=1):
    """A stand-in for ``model.strategy`` with only what callbacks read."""
    resolver = None if task_id is None else SimpleNamespace(task_type="worker", task_id=task_id)
    return SimpleNamespace(is_chief=is_chief, cluster_resolver=resolver)


def run_fit(model, callbacks, epoch_logs, steps=2, verbose=0, batch_logs=None, train=None, batches=3):
    """Drives the hooks the way `Model.fit` does; ``train(model, epoch)`` stands for an epoch's work.

    ``steps`` is what fit announces (None: unknown); ``batches`` run per epoch when it is None.
    """
    cbs = C.CallbackList(
        callbacks,
        add_history=True,
        add_progbar=verbose != 0,
        model=model,
        verbose=verbose,
        epochs=len(epoch_logs),
        steps=steps,
    )
    model.stop_training = False
    cbs.on_train_begin()
    logs = {}
    for epoch, values in enumerate(epoch_logs):
        cbs.on_epoch_begin(epoch)
        for batch in range(steps if steps is not None else batches):
            cbs.on_train_batch_begin(batch)
            cbs.on_train_batch_end(batch, dict(batch_logs(epoch, batch) if batch_logs else values))
            if model.stop_training:
                break
        if train is not None:
            train(model, epoch)
        logs = dict(values)
        cbs.on_epoch_end(epoch, logs)
        if model.stop_training:
            break
    cbs.on_train_end(logs)
    return model.history


@pytest.fixture
def fakes():
    return SimpleNamespace(Model=FakeModel, strategy=strategy, fit=run_fit)
