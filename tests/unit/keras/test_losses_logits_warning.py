"""Keras-name cross-entropies on logits with from_logits=False: one warning per loss object, with the fix."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch

import phalanx
from phalanx import losses as L
from phalanx.losses import builtin


def _caught(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [w for w in caught if "look like logits" in str(w.message)]


def test_the_issues_case_compile_by_name_on_a_logits_model_warns_once_and_names_the_fix():
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    y = torch.randint(0, 4, (64,))
    strategy = phalanx.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        model = phalanx.Model(net)
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    caught = _caught(lambda: model.fit(x, y, batch_size=16, epochs=2, verbose=0))
    assert len(caught) == 1  # 8 steps x 2 replicas, one warning
    message = str(caught[0].message)
    assert "from_logits=False, Keras' default" in message
    assert "HINT: pass from_logits=True" in message
    assert "SparseCategoricalCrossentropy(from_logits=True)" in message


@pytest.mark.parametrize(
    ("loss", "y_true", "y_pred"),
    [
        (L.SparseCategoricalCrossentropy, torch.tensor([0, 1]), torch.tensor([[2.0, -1.0], [0.5, 3.0]])),
        (L.CategoricalCrossentropy, torch.eye(2), torch.tensor([[2.0, -1.0], [0.5, 3.0]])),
        (L.BinaryCrossentropy, torch.tensor([[0.0], [1.0]]), torch.tensor([[-2.0], [3.0]])),
    ],
)
def test_each_cross_entropy_warns_once_per_object(loss, y_true, y_pred):
    first = loss()
    assert len(_caught(lambda: [first(y_true, y_pred) for _ in range(3)])) == 1
    assert len(_caught(lambda: loss()(y_true, y_pred))) == 1  # a new object warns again


def test_rows_that_do_not_sum_to_one_warn_for_the_categorical_ones_only():
    scores = torch.tensor([[0.2, 0.3], [0.9, 0.8]])  # in [0, 1], but not distributions
    assert len(_caught(lambda: L.SparseCategoricalCrossentropy()(torch.tensor([0, 1]), scores))) == 1
    assert _caught(lambda: L.BinaryCrossentropy()(torch.tensor([[0.0, 1.0], [1.0, 0.0]]), scores)) == []


def test_probabilities_and_from_logits_true_do_not_warn():
    logits = torch.randn(5, 3)
    y = torch.tensor([0, 1, 2, 1, 0])
    assert _caught(lambda: L.SparseCategoricalCrossentropy()(y, logits.softmax(-1))) == []
    assert _caught(lambda: L.SparseCategoricalCrossentropy(from_logits=True)(y, logits)) == []
    assert _caught(lambda: L.get("binary_crossentropy")(torch.ones(5, 1), torch.rand(5, 1))) == []


def test_only_the_first_calls_are_checked():
    loss = L.SparseCategoricalCrossentropy()
    y = torch.tensor([0, 1])
    probs = torch.tensor([[0.9, 0.1], [0.2, 0.8]])
    for _ in range(builtin.LOGITS_CHECKED_CALLS):
        loss(y, probs)
    # No more device reads once training is under way (the check stops, it does not slow every step).
    assert _caught(lambda: loss(y, torch.tensor([[5.0, -5.0], [0.0, 2.0]]))) == []


def test_a_loss_that_warned_still_pickles_and_keeps_its_config():
    loss = L.CategoricalCrossentropy()
    _caught(lambda: loss(torch.eye(2), torch.tensor([[3.0, -1.0], [0.0, 2.0]])))
    copy = pickle.loads(pickle.dumps(loss))
    assert copy.get_config() == loss.get_config()
    assert "warned" not in str(loss.get_config())
