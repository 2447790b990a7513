"""phalanx.callbacks under fit: Keras behaviour, chief-only files, errors."""

from __future__ import annotations

import csv
import os

import pytest
import torch
from torch import nn

import phalanx
from phalanx import callbacks as C


def _model(strategy=None, lr=0.1):
    strategy = strategy or phalanx.OneDeviceStrategy("cpu")
    torch.manual_seed(0)
    with strategy.scope():
        model = phalanx.Model(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)))
        model.compile(
            torch.optim.SGD(model.parameters(), lr=lr),
            loss=phalanx.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    return model


def _data(n=40):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


class Recorder(C.Callback):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __getattribute__(self, name):
        if name.startswith("on_"):
            return lambda *a, **k: object.__getattribute__(self, "calls").append(name)
        return object.__getattribute__(self, name)


def test_hook_order_and_params():
    rec = Recorder()
    x, y = _data(20)
    _model().fit(x, y, batch_size=10, epochs=2, verbose=0, validation_data=(x, y), callbacks=[rec])
    assert rec.calls[0] == "on_train_begin"
    assert rec.calls[-1] == "on_train_end"
    assert rec.calls.count("on_epoch_begin") == 2
    assert rec.calls.count("on_train_batch_end") == 4
    assert rec.params["epochs"] == 2
    assert rec.params["steps"] == 2


def test_early_stopping_restores_best_weights():
    x, y = _data()
    model = _model(lr=5.0)  # diverges after a while
    stop = C.EarlyStopping(monitor="loss", patience=1, restore_best_weights=True)
    snapshots = []
    record = C.LambdaCallback(
        on_epoch_end=lambda e, logs: snapshots.append(
            (logs["loss"], {k: v.clone() for k, v in model.state_dict().items()})
        )
    )
    history = model.fit(x, y, batch_size=40, epochs=30, verbose=0, callbacks=[record, stop])
    assert len(history.epoch) < 30
    best = min(snapshots, key=lambda s: s[0])[1]
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, best[k])


def test_learning_rate_callbacks():
    x, y = _data()
    model = _model()
    h = model.fit(x, y, epochs=3, verbose=0, callbacks=[C.LearningRateScheduler(lambda e, lr: 0.1 / (e + 1))])
    assert h.history["learning_rate"] == pytest.approx([0.1, 0.05, 0.1 / 3])
    plateau = C.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=10.0)
    model.fit(x, y, epochs=2, verbose=0, callbacks=[plateau])
    assert model.optimizer.param_groups[0]["lr"] == pytest.approx(
        0.1 / 3 / 2
    )  # epoch 0 sets the best; epoch 1 reduces
    with pytest.raises(ValueError, match="factor >= 1"):
        C.ReduceLROnPlateau(factor=2.0)
    with pytest.raises(ValueError, match="must return a number"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[C.LearningRateScheduler(lambda e, lr: "x")])


def test_csv_logger_and_terminate_on_nan(tmp_path):
    x, y = _data()
    path = str(tmp_path / "log.csv")
    _model().fit(x, y, epochs=2, verbose=0, callbacks=[C.CSVLogger(path)])
    with open(path) as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["epoch", "accuracy", "loss"]
    assert len(rows) == 3
    bad = x.clone()
    bad[0, 0] = float("nan")
    h = _model().fit(bad, y, batch_size=10, epochs=3, verbose=0, callbacks=[C.TerminateOnNaN()])
    assert len(h.epoch) == 1


def test_model_checkpoint_best_only_and_templates(tmp_path):
    x, y = _data()
    template = str(tmp_path / "w-{epoch:02d}-{loss:.2f}.pt")
    ckpt = C.ModelCheckpoint(template, monitor="loss", save_best_only=True, save_weights_only=True)
    _model().fit(x, y, epochs=3, verbose=0, callbacks=[ckpt])
    names = sorted(os.listdir(tmp_path))
    assert names[0].startswith("w-01-")
    full = C.ModelCheckpoint(str(tmp_path / "full.pt"), save_freq=2)
    _model().fit(x, y, batch_size=10, epochs=1, verbose=0, callbacks=[full])
    assert phalanx.load_model(
        str(tmp_path / "full.pt"), module=nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    ).metrics_names == ["loss", "accuracy"]
    with pytest.raises(ValueError, match="save_freq must be"):
        C.ModelCheckpoint("x", save_freq=0)


def test_progress_bar_on_chief_only(capsys):
    x, y = _data()
    _model().fit(x, y, batch_size=20, epochs=1, verbose=2)
    out = capsys.readouterr().out
    assert "Epoch 1/1" in out
    assert "2/2 - " in out
    assert "loss: " in out
    model = _model()
    model._strategy = type(
        "NotChief",
        (),
        {
            "is_chief": False,
            "run": model.strategy.run,
            "experimental_distribute_dataset": model.strategy.experimental_distribute_dataset,
        },
    )()
    model.fit(x, y, batch_size=20, epochs=1, verbose=1)
    assert "Epoch" not in capsys.readouterr().out


def test_callback_errors():
    with pytest.raises(TypeError, match="must be phalanx.callbacks.Callback"):
        C.CallbackList([object()])
    with pytest.raises(ValueError, match="unknown hook"):
        C.LambdaCallback(on_nothing=lambda: None)
    with pytest.raises(ValueError, match="mode must be"):
        C.EarlyStopping(mode="up")
    with pytest.raises(ValueError, match="save_freq must be"):
        C.BackupAndRestore("d", save_freq="often")
    with pytest.raises(ValueError, match="needs a backup_dir"):
        C.BackupAndRestore("")


def test_tensorboard_needs_the_extra_or_writes(tmp_path):
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"phalanx\[tensorboard\]"):
            C.TensorBoard(str(tmp_path))
        return
    x, y = _data()
    _model().fit(x, y, epochs=1, verbose=0, callbacks=[C.TensorBoard(str(tmp_path))])
    assert os.listdir(tmp_path)


def test_early_stopping_min_delta_requires_a_real_improvement():
    stop = C.EarlyStopping(monitor="loss", min_delta=0.5, patience=0)
    stop.set_model(type("M", (), {"stop_training": False})())
    stop.on_train_begin()
    stop.on_epoch_end(0, {"loss": 1.0})
    stop.on_epoch_end(1, {"loss": 0.9})  # better by 0.1 < min_delta: not an improvement
    assert stop.model.stop_training
