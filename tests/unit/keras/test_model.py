"""phalanx.Model: compile / fit / evaluate / predict / save under every in-process strategy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import phalanx


class Net(nn.Module):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.hidden = hidden
        self.body = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 3))

    def forward(self, x):
        return self.body(x)

    def get_config(self):
        return {"hidden": self.hidden}


def _data(n=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def _compiled(strategy, **compile_kwargs):
    torch.manual_seed(0)
    with strategy.scope():
        model = phalanx.Model(Net())
        model.compile(
            optimizer=compile_kwargs.pop("optimizer", "sgd"),
            loss=compile_kwargs.pop("loss", phalanx.losses.SparseCategoricalCrossentropy(from_logits=True)),
            metrics=compile_kwargs.pop("metrics", ["accuracy"]),
            **compile_kwargs,
        )
    return model


def test_fit_evaluate_predict_agree_across_strategies(any_strategy):
    x, y = _data()
    reference = _compiled(phalanx.OneDeviceStrategy("cpu"))
    model = _compiled(any_strategy)
    h_ref = reference.fit(x, y, batch_size=20, epochs=2, verbose=0, shuffle=False)
    h = model.fit(x, y, batch_size=20, epochs=2, verbose=0, shuffle=False)
    np.testing.assert_allclose(h.history["loss"], h_ref.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(h.history["accuracy"], h_ref.history["accuracy"], rtol=1e-6)
    assert model.evaluate(x, y, batch_size=16, verbose=0) == pytest.approx(
        reference.evaluate(x, y, batch_size=16, verbose=0), rel=1e-5
    )
    torch.testing.assert_close(model.predict(x, batch_size=16), reference.predict(x, batch_size=16))


def test_predict_keeps_input_order_with_partial_batches(mirrored_2cpu):
    with mirrored_2cpu.scope():
        model = phalanx.Model(nn.Identity())
    x = torch.arange(53, dtype=torch.float32).reshape(53, 1)
    torch.testing.assert_close(model.predict(x, batch_size=8), x)


def test_history_metrics_and_validation(mirrored_2cpu):
    x, y = _data(60)
    model = _compiled(mirrored_2cpu, metrics=["accuracy", "sparse_top_k_categorical_accuracy"])
    history = model.fit(x, y, batch_size=16, epochs=3, validation_split=0.25, verbose=0)
    assert set(history.history) == {
        "loss",
        "accuracy",
        "sparse_top_k_categorical_accuracy",
        "val_loss",
        "val_accuracy",
        "val_sparse_top_k_categorical_accuracy",
    }
    assert history.epoch == [0, 1, 2]
    assert model.metrics_names == ["loss", "accuracy", "sparse_top_k_categorical_accuracy"]
    val = model.evaluate(x[45:], y[45:], verbose=0, return_dict=True)
    assert val["loss"] == pytest.approx(history.history["val_loss"][-1], rel=1e-5)


def test_fit_accepts_dataloader_dataset_and_steps_per_epoch(mirrored_2cpu):
    x, y = _data(40)
    model = _compiled(mirrored_2cpu)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=10)
    assert len(model.fit(loader, epochs=2, verbose=0).history["loss"]) == 2

    def forever():
        while True:
            yield x[:10], y[:10]

    steps = []
    counted = phalanx.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: steps.append(batch))
    history = model.fit(forever(), epochs=2, steps_per_epoch=3, verbose=0, callbacks=[counted])
    assert len(history.history["loss"]) == 2
    assert steps == [0, 1, 2, 0, 1, 2]


def test_sample_weight_and_multiple_outputs(one_device):
    x, y = _data(20)

    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 1)

        def forward(self, t):
            return self.a(t), self.b(t).squeeze(-1)

    with one_device.scope():
        model = phalanx.Model(TwoHeads())
        model.compile(
            "adam",
            loss=[phalanx.losses.SparseCategoricalCrossentropy(from_logits=True), "mse"],
            loss_weights=[1.0, 0.5],
        )
    target = (y, torch.zeros(20))
    h = model.fit(x, target, batch_size=5, epochs=1, sample_weight=torch.ones(20), verbose=0)
    assert np.isfinite(h.history["loss"][0])


def test_train_and_test_on_batch(one_device):
    x, y = _data(8)
    model = _compiled(one_device)
    loss, acc = model.train_on_batch(x, y)
    assert loss > 0
    assert 0 <= acc <= 1
    assert set(model.test_on_batch(x, y, return_dict=True)) == {"loss", "accuracy"}
    assert model.predict_on_batch(x).shape == (8, 3)


def test_save_and_load_model_round_trip_across_strategies(tmp_path, mirrored_2cpu, one_device):
    x, y = _data()
    model = _compiled(mirrored_2cpu, optimizer="adam")
    model.fit(x, y, batch_size=10, epochs=1, verbose=0)
    path = str(tmp_path / "model.pt")
    model.save(path)
    with one_device.scope():
        loaded = phalanx.load_model(path, custom_objects={"Net": Net})
    torch.testing.assert_close(loaded.predict(x), model.predict(x))
    assert loaded.metrics_names == ["loss", "accuracy"]
    assert (
        loaded.optimizer.state_dict()["state"][0]["step"] == model.optimizer.state_dict()["state"][0]["step"]
    )
    loaded.fit(x, y, batch_size=10, epochs=1, verbose=0)


def test_load_model_never_imports_unknown_classes(tmp_path, one_device):
    model = _compiled(one_device)
    path = str(tmp_path / "m.pt")
    model.save(path)
    payload = torch.load(path, weights_only=True)
    payload["module_class"] = "some_unimported_module:Evil"
    torch.save(payload, path)
    with pytest.raises(ValueError, match="never imports code named by a file"):
        phalanx.load_model(path)
    torch.save({"x": 1}, path)
    with pytest.raises(ValueError, match="not a phalanx model file"):
        phalanx.load_model(path)


def test_save_and_load_weights(tmp_path, mirrored_2cpu):
    model = _compiled(mirrored_2cpu)
    path = str(tmp_path / "w.pt")
    model.save_weights(path)
    plain = Net()
    plain.load_state_dict(torch.load(path, weights_only=True))
    other = _compiled(phalanx.get_strategy())
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    other.load_weights(path)
    torch.testing.assert_close(other.predict(_data()[0]), model.predict(_data()[0]))
    weights = model.get_weights()
    other.set_weights([w * 0 for w in weights])
    assert all(float(abs(w).sum()) == 0 for w in other.get_weights())
    with pytest.raises(ValueError, match="set_weights expects"):
        other.set_weights(weights[:1])


def test_summary_lists_layers(one_device):
    lines = []
    _compiled(one_device).summary(print_fn=lines.append)
    text = "\n".join(lines)
    assert "body.0 (Linear)" in text
    assert "Total params: 131" in text


@pytest.mark.parametrize("name", ["one_device", "mirrored_2cpu"])
def test_jit_compile_trains_like_eager(request, name):
    strategy = request.getfixturevalue(name)
    x, y = _data(16)
    eager = _compiled(strategy)
    jit = _compiled(strategy, jit_compile=True)
    h_eager = eager.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    h_jit = jit.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    np.testing.assert_allclose(h_jit.history["loss"], h_eager.history["loss"], rtol=1e-5)
    assert jit.get_compile_config()["jit_compile"] is True
    with strategy.scope():
        assert phalanx.Model(Net()).get_compile_config() is None  # not compiled


def test_errors(one_device):
    with pytest.raises(TypeError, match="wraps a torch.nn.Module"):
        phalanx.Model(3)
    with one_device.scope():
        model = phalanx.Model(Net())
    x, y = _data(8)
    with pytest.raises(RuntimeError, match="must be compiled"):
        model.fit(x, y)
    with pytest.raises(ValueError, match="Unknown optimizer"):
        model.compile("nope", loss="mse")
    with pytest.raises(ValueError, match="needs a loss"):
        model.compile("sgd", loss=None)
    model.compile("sgd", loss="mse")
    with pytest.raises(ValueError, match="batch_size is only accepted with array inputs"):
        model.fit(iter([(x, y)]), batch_size=4)
    with pytest.raises(ValueError, match="validation_split must be in"):
        model.fit(x, y, validation_split=1.5)
    with pytest.raises(ValueError, match="No data"):
        model.fit(None)
    with pytest.raises(ValueError, match="steps_per_epoch must be positive"):
        model.fit(x, y, steps_per_epoch=0)
    with pytest.raises(ValueError, match=r"A batch must be x, \(x, y\)"):
        model.fit(iter([(x, y, None, None)]), verbose=0)


class _SquaredErrorStep(phalanx.Model):
    """A Keras 3-style ``train_step`` override: unpacks ``(x, y)`` itself and updates the model."""

    def train_step(self, data):
        self.calls.append(len(data))
        x, y = data
        per_example = ((self(x) - y) ** 2).mean(dim=-1)
        phalanx.compute_average_loss(per_example).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.metrics[0].update_state(per_example)  # the loss tracker: fit's "loss" log


class _CountedTestStep(phalanx.Model):
    """A ``test_step`` override around the built-in one."""

    def test_step(self, data):
        self.seen.append(len(data))
        return super().test_step(data)


def _regression(cls, strategy):
    torch.manual_seed(0)
    with strategy.scope():
        model = cls(nn.Linear(4, 2))
        model.compile(optimizer="sgd", loss="mse")
    return model


@pytest.mark.parametrize("name", ["one_device", "mirrored_2cpu"])
def test_an_overridden_train_step_trains_as_the_built_in_one(request, name):
    strategy = request.getfixturevalue(name)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 4, generator=g), torch.randn(32, 2, generator=g)
    built_in, custom = _regression(phalanx.Model, strategy), _regression(_SquaredErrorStep, strategy)
    custom.calls = []
    h_built_in = built_in.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    h_custom = custom.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    for ours, theirs in zip(custom.get_weights(), built_in.get_weights(), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(h_custom.history["loss"], h_built_in.history["loss"], rtol=1e-5)
    assert custom.calls == [2] * (8 * strategy.num_local_replicas)  # 8 steps, (x, y) on each replica


def test_an_overridden_test_step_gets_the_batch_as_keras_packs_it(one_device):
    model = _regression(_CountedTestStep, one_device)
    model.seen = []
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    model.evaluate(x, y, batch_size=4, verbose=0)
    model.evaluate(x, y, batch_size=4, verbose=0, sample_weight=torch.ones(8))
    assert model.seen == [2, 2, 3, 3]  # (x, y), then (x, y, sample_weight)
    assert model.predict(x, batch_size=4).shape == (8, 2)  # predict_step gets (x,)
