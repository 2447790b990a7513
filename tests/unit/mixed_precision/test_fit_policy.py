"""Model.fit / evaluate / predict under the global mixed-precision policy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import phalanx
from phalanx import mixed_precision


@pytest.fixture(autouse=True)
def _restore_global_policy():
    before = mixed_precision.global_policy()
    yield
    mixed_precision.set_global_policy(before)


def _fit(strategy, policy: str):
    mixed_precision.set_global_policy(policy)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 6)).astype(np.float32)
    y = rng.normal(size=(32, 1)).astype(np.float32)
    with strategy.scope():
        torch.manual_seed(0)
        model = phalanx.Model(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1)))
        model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    evaluated = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    predicted = model.predict(x, batch_size=8, verbose=0)
    return model, history.history, evaluated, predicted


@pytest.mark.parametrize("runner", ["one_device", "mirrored_2cpu", "central_storage_2cpu"], indirect=True)
def test_mixed_bfloat16_computes_in_bfloat16_and_keeps_float32_state(runner):
    model, history, evaluated, predicted = runner.run(_fit, "mixed_bfloat16")[0]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert np.asarray(predicted).dtype == np.float32
    assert model._loss_scale is None  # bfloat16 needs no loss scaling
    _, f32_history, _, _ = _fit(phalanx.OneDeviceStrategy("cpu"), "float32")
    _, bf16_history, _, _ = _fit(phalanx.OneDeviceStrategy("cpu"), "mixed_bfloat16")
    assert history["loss"] != f32_history["loss"]  # autocast took effect
    np.testing.assert_allclose(history["loss"], bf16_history["loss"], rtol=2e-2)
    np.testing.assert_allclose(history["loss"], f32_history["loss"], rtol=5e-2)  # and stays close
    assert np.isfinite(evaluated["loss"])


def test_mixed_float16_fit_scales_the_loss_under_mirrored(mirrored_2cpu):
    model, history, evaluated, _ = _fit(mirrored_2cpu, "mixed_float16")
    assert isinstance(model._loss_scale, mixed_precision.GradScaler)
    assert model._loss_scale.get_scale() == 2.0**16  # no overflow in this small model
    assert np.all(np.isfinite(history["loss"]))
    _, f32_history, _, _ = _fit(phalanx.OneDeviceStrategy("cpu"), "float32")
    np.testing.assert_allclose(history["loss"], f32_history["loss"], rtol=5e-2)
