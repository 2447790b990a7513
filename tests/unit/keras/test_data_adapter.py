"""What fit/evaluate/predict accept: NumPy of any numeric dtype, Python
lists, tuples/dicts of arrays, phalanx.data.Dataset and DataLoader; floating inputs cast to the
model's parameter dtype (Keras' floatx rule)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.keras.data_adapter import DataHandler, float_dtype_of


def _linear(strategy: phalanx.Strategy, dtype: torch.dtype = torch.float32) -> phalanx.Model:
    torch.manual_seed(0)
    with strategy.scope():
        model = phalanx.Model(nn.Linear(1, 1).to(dtype))
        model.compile(optimizer="sgd", loss="mse")
    return model


def test_the_first_keras_example_trains_on_float64_numpy(any_strategy):
    """model.fit(np.ones((100, 1)), np.ones((100, 1)), batch_size=10): float64 arrays."""
    model = _linear(any_strategy)
    history = model.fit(np.ones((100, 1)), np.ones((100, 1)), batch_size=10, epochs=2, verbose=0)
    reference = _linear(phalanx.OneDeviceStrategy("cpu"))
    expected = reference.fit(
        torch.ones(100, 1), torch.ones(100, 1), batch_size=10, epochs=2, verbose=0, shuffle=True
    )
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-6)
    assert model.evaluate(np.ones((10, 1)), np.ones((10, 1)), verbose=0) == pytest.approx(
        reference.evaluate(torch.ones(10, 1), torch.ones(10, 1), verbose=0), rel=1e-6
    )
    predictions = model.predict(np.ones((10, 1), dtype=np.float16), verbose=0)
    assert predictions.dtype == torch.float32
    assert predictions.shape == (10, 1)


def test_a_float64_model_keeps_float64_inputs(one_device):
    model = _linear(one_device, torch.float64)
    predictions = model.predict(np.full((4, 1), 1 / 3), verbose=0)
    assert predictions.dtype == torch.float64
    weight, bias = model.module.weight.item(), model.module.bias.item()
    np.testing.assert_array_equal(predictions.numpy(), np.full((4, 1), weight / 3 + bias))


def test_python_lists_of_numbers(one_device):
    model = _linear(one_device)
    history = model.fit([[1.0], [2.0], [3.0], [4.0]], [[1], [2], [3], [4]], batch_size=2, verbose=0)
    reference = _linear(phalanx.OneDeviceStrategy("cpu"))
    x = torch.arange(1.0, 5.0).reshape(4, 1)
    expected = reference.fit(x, x, batch_size=2, verbose=0)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-6)


def test_integer_inputs_stay_integers_for_embeddings(mirrored_2cpu):
    with mirrored_2cpu.scope():
        model = phalanx.Model(nn.Sequential(nn.Embedding(10, 3), nn.Flatten(), nn.Linear(6, 1)))
        model.compile(optimizer="sgd", loss="mse")
    ids = np.arange(20, dtype=np.uint32).reshape(10, 2) % 10
    history = model.fit(ids, np.zeros((10, 1)), batch_size=4, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    handler = DataHandler(ids, np.zeros(10), batch_size=4, float_dtype=torch.float32)
    x, y, _ = next(handler.epoch(0))
    assert x.dtype == torch.int64  # torch's index dtype (nn.Embedding takes no other)
    assert y.dtype == torch.float32
    for dtype in (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64):
        out = model.predict(ids.astype(dtype), verbose=0)
        torch.testing.assert_close(out, model.predict(ids.astype(np.int64), verbose=0))


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(2, 1), nn.Linear(3, 1)

    def forward(self, inputs):
        if isinstance(inputs, dict):
            return self.a(inputs["a"]) + self.b(inputs["b"])
        return self.a(inputs[0]) + self.b(inputs[1])


@pytest.mark.parametrize("container", ["tuple", "list", "dict"])
def test_tuples_lists_and_dicts_of_float64_arrays(mirrored_2cpu, container):
    torch.manual_seed(0)
    with mirrored_2cpu.scope():
        model = phalanx.Model(TwoInputs())
        model.compile(optimizer="sgd", loss="mse")
    a, b = np.ones((8, 2)), np.ones((8, 3))
    x = {"tuple": (a, b), "list": [a, b], "dict": {"a": a, "b": b}}[container]
    history = model.fit(x, np.ones(8), batch_size=4, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert model.predict(x, batch_size=4, verbose=0).shape == (8, 1)


def test_datasets_and_dataloaders_of_float64_tensors(mirrored_2cpu):
    x, y = torch.ones(16, 1, dtype=torch.float64), torch.ones(16, 1, dtype=torch.float64)
    sources = [
        phalanx.data.Dataset.from_tensor_slices((x, y)).batch(4),
        DataLoader(TensorDataset(x, y), batch_size=4),
    ]
    losses = []
    for source in sources:
        model = _linear(mirrored_2cpu)
        losses.append(model.fit(source, epochs=2, verbose=0).history["loss"])
        assert model.module.weight.dtype == torch.float32
    reference = _linear(phalanx.OneDeviceStrategy("cpu"))
    expected = reference.fit(x.float(), y.float(), batch_size=4, epochs=2, shuffle=False, verbose=0)
    for got in losses:
        np.testing.assert_allclose(got, expected.history["loss"], rtol=1e-6)


def test_float_dtype_of_a_module():
    assert float_dtype_of(nn.Linear(1, 1)) == torch.float32
    assert float_dtype_of(nn.Linear(1, 1).double()) == torch.float64
    assert float_dtype_of(nn.Identity()) == torch.get_default_dtype()
    assert float_dtype_of(nn.Embedding(2, 2).half()) == torch.float16


def test_arrays_of_strings_raise(one_device):
    model = _linear(one_device)
    with pytest.raises(TypeError, match=r"numeric arrays.*Received: an array of dtype <U1.*HINT: encode"):
        model.fit(np.array([["a"], ["b"]]), np.ones((2, 1)), verbose=0)
