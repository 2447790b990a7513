"""Model.fit under a strategy reproduces TensorFlow's recorded fit trajectories."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import phalanx
from support import oracle


def _fit(strategy, n):
    """One epoch of Model.fit over the first ``n`` examples; returns the model and its History."""
    x, y = oracle.dataset(n)
    with strategy.scope():
        model = phalanx.Model(oracle.OracleNet())
        model.compile(
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            loss=phalanx.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    history = model.fit(x, y, batch_size=oracle.GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    return model, history


def _fitted_weights(strategy, n):
    """(each process) The weights after one epoch of fit."""
    model, _ = _fit(strategy, n)
    return model.module.state_dict()


@pytest.mark.parametrize(
    "runner", ["one_device", "mirrored_2cpu", "central_storage_2cpu", "mwms_2workers"], indirect=True
)
def test_fit_one_epoch_matches_ctl_final_weights(runner):
    ref, _ = oracle.reference("ctl_mirrored")
    for weights in runner.run(_fitted_weights, 256):
        for key, value in weights.items():
            np.testing.assert_allclose(value.numpy(), ref[f"final/torch/{key}"], **oracle.WEIGHT_TOL)


def test_fit_uneven_matches_keras_fit(mirrored_2cpu):
    model, history = _fit(mirrored_2cpu, 250)
    ref, meta = oracle.reference("uneven250_mirrored")
    for key, value in model.module.state_dict().items():
        np.testing.assert_allclose(value.numpy(), ref[f"fit/final/torch/{key}"], **oracle.WEIGHT_TOL)
    # 13 / 13 last split: TF's mean of per-replica running means equals the true global mean
    np.testing.assert_allclose(
        history.history["loss"], meta["variants"]["fit"]["history_loss"], **oracle.LOSS_TOL
    )


def test_history_loss_is_true_global_mean_with_unequal_split(mirrored_2cpu):
    # 25 examples, one batch: replicas get 13 and 12; the logged loss averages all 25 examples.
    x, y = oracle.dataset(25)
    with mirrored_2cpu.scope():
        model = phalanx.Model(oracle.OracleNet())
        model.compile(
            optimizer=torch.optim.SGD(model.parameters(), lr=0.0), loss="sparse_categorical_crossentropy"
        )
    expected = phalanx.losses.get("sparse_categorical_crossentropy")(y, model.module(x)).item()
    history = model.fit(x, y, batch_size=25, epochs=1, shuffle=False, verbose=0)
    assert history.history["loss"][0] == pytest.approx(expected, rel=1e-6)
