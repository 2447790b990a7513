"""ProgbarLogger: Keras' progress text (pure formatting), the tqdm display, chief-only printing."""

from __future__ import annotations

import re

import pytest
import torch

import phalanx
from phalanx import callbacks as C
from phalanx.callbacks import _progbar
from phalanx.callbacks import _progbar_format as fmt
from phalanx.callbacks._progbar import Progbar


@pytest.fixture(autouse=True)
def terminal(monkeypatch):
    """Pretend stdout is a terminal (pytest captures it): the live line redraws."""
    monkeypatch.setattr(_progbar, "dynamic_display", lambda: True)


def test_number_format_is_keras():
    assert fmt.format_value(0.28) == "0.2800"
    assert fmt.format_value(-1.5) == "-1.5000"
    assert fmt.format_value(1e-5) == "1.0000e-05"
    assert fmt.format_value(0.0) == "0.0000e+00"  # Keras: |v| <= 1e-3 is scientific, zero included
    assert fmt.format_value(torch.tensor(0.91)) == "0.9100"
    assert fmt.format_value([0.5, 1.0]) == "0.7500"  # several values: their mean
    assert fmt.format_value("n/a") == "n/a"
    assert fmt.format_value(object()).startswith("<object")
    assert fmt.format_logs({"loss": 0.28, "accuracy": 0.91}) == "loss: 0.2800 - accuracy: 0.9100"
    assert fmt.format_logs(None) == ""


def test_time_formats():
    assert fmt.format_time(0.012) == "12ms/step"
    assert fmt.format_time(2.4, "epoch") == "2s/epoch"
    assert fmt.format_time(0.0) == "0s/step"
    assert fmt.format_time(5e-5) == "50us/step"
    assert fmt.format_eta(3.7) == "3s"
    assert fmt.format_eta(125) == "2:05"
    assert fmt.format_eta(3725) == "1:02:05"


def test_bar_and_lines():
    assert fmt.bar(70, 70) == "70/70 [==============================]"
    assert fmt.bar(35, 70) == "35/70 [==============>...............]"
    assert fmt.bar(0, 70) == " 0/70 [..............................]"
    assert fmt.bar(12, None) == "     12/Unknown"
    logs = {"loss": 0.28, "accuracy": 0.91}
    assert fmt.progress_line(70, 70, 0.84, 0.012, logs, finalize=True) == (
        "70/70 [==============================] - 1s 12ms/step - loss: 0.2800 - accuracy: 0.9100"
    )
    assert fmt.progress_line(35, 70, 0.4, 0.1, {}, finalize=False) == (
        "35/70 [==============>...............] - ETA: 3s"
    )
    assert fmt.progress_line(12, None, 3.2, 0.25, logs, finalize=False).startswith(
        "     12/Unknown - 3s 250ms/step"
    )
    assert (
        fmt.summary_line(70, 70, 0.84, 0.012, logs)
        == "70/70 - 1s - 12ms/step - loss: 0.2800 - accuracy: 0.9100"
    )


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_time_per_step_leaves_the_first_step_out(capsys):
    clock = Clock()
    bar = Progbar(3, verbose=2, clock=clock)
    clock.now += 5.0  # slow first step (warm-up)
    bar.update(1)
    clock.now += 0.1
    bar.update(2)
    clock.now += 0.1
    bar.update(3, {"loss": 0.5}, finalize=True)
    assert capsys.readouterr().out == "3/3 - 5s - 100ms/step - loss: 0.5000\n"


def test_live_bar_redraws_at_most_every_interval(capsys):
    clock = Clock()
    bar = Progbar(4, verbose=1, interval=1.0, clock=clock)
    for step in (1, 2, 3):
        clock.now += 0.1
        bar.update(step, {"loss": 1.0})
    clock.now += 0.1
    bar.update(4, {"loss": 0.5}, finalize=True)
    out = capsys.readouterr().out
    assert out.count("1/4 [") == 1  # steps 2 and 3 came too soon
    assert "2/4 [" not in out
    assert "4/4 [==============================] - 0s 100ms/step - loss: 0.5000" in out
    assert out.endswith("\n")


def test_without_a_terminal_only_finished_lines_are_printed(capsys, monkeypatch):
    monkeypatch.setattr(_progbar, "dynamic_display", lambda: False)
    clock = Clock()
    bar = Progbar(2, verbose=1, clock=clock)
    clock.now += 1.0
    bar.update(1, {"loss": 1.0})
    clock.now += 1.0
    bar.update(2, {"loss": 0.5}, finalize=True)
    assert capsys.readouterr().out == "2/2 [==============================] - 2s 1s/step - loss: 0.5000\n"


def test_dynamic_display_follows_stdout(monkeypatch):
    monkeypatch.undo()
    assert _progbar.dynamic_display() is False  # pytest's capture is not a terminal


def fit_output(fakes, capsys, **kwargs):
    kwargs.setdefault("steps", 3)
    fakes.fit(kwargs.pop("model", None) or fakes.Model(), kwargs.pop("callbacks", []), **kwargs)
    return capsys.readouterr().out


def test_verbose_one_shows_a_bar_per_epoch(fakes, capsys):
    out = fit_output(fakes, capsys, epoch_logs=[{"loss": 0.28, "accuracy": 0.91}] * 2, verbose=1)
    assert "Epoch 1/2" in out
    assert "Epoch 2/2" in out
    assert re.search(r"3/3 \[=+\] - \d+s \d+(us|ms|s)/step - loss: 0\.2800 - accuracy: 0\.9100", out)


def test_verbose_two_prints_one_line_per_epoch(fakes, capsys):
    out = fit_output(fakes, capsys, epoch_logs=[{"loss": 0.28}] * 2, verbose=2)
    lines = out.splitlines()
    assert lines[0] == "Epoch 1/2"
    assert re.fullmatch(r"3/3 - \d+s - \d+(us|ms|s)/step - loss: 0\.2800", lines[1])
    assert len(lines) == 4
    assert "[" not in out


def test_one_epoch_prints_its_header_like_tf_keras(fakes, capsys):
    out = fit_output(fakes, capsys, epoch_logs=[{"loss": 0.28}], verbose=2)
    assert out.splitlines()[0] == "Epoch 1/1"


def test_verbose_zero_and_non_chief_print_nothing(fakes, capsys):
    assert fit_output(fakes, capsys, epoch_logs=[{"loss": 1.0}] * 2, verbose=0) == ""
    worker = fakes.Model(strategy=fakes.strategy(is_chief=False))
    assert fit_output(fakes, capsys, model=worker, epoch_logs=[{"loss": 1.0}] * 2, verbose=1) == ""
    logger = C.ProgbarLogger()
    assert (
        fit_output(fakes, capsys, model=worker, callbacks=[logger], epoch_logs=[{"loss": 1.0}] * 2, verbose=2)
        == ""
    )


def test_unknown_steps_then_learnt(fakes, capsys):
    out = fit_output(fakes, capsys, epoch_logs=[{"loss": 1.0}] * 2, verbose=1, steps=None)
    assert "      1/Unknown" in out
    assert "3/3 [==============================]" in out  # the first epoch taught the length


def test_early_stop_shows_where_it_stopped(fakes, capsys):
    def batches(epoch, batch):
        return {"loss": float("nan") if batch == 1 else 1.0}

    out = fit_output(
        fakes,
        capsys,
        callbacks=[C.TerminateOnNaN()],
        epoch_logs=[{"loss": 1.0}],
        verbose=1,
        steps=4,
        batch_logs=batches,
    )
    assert "2/4 [==============>...............] - 0s" in out


def test_evaluate_and_predict_outside_fit(fakes, capsys):
    logger = C.ProgbarLogger()
    cbs = C.CallbackList([logger], model=fakes.Model(), verbose=1, epochs=1, steps=2)
    cbs.on_test_begin()
    cbs.on_test_batch_end(0, {"loss": 0.5})
    cbs.on_test_batch_end(1, {"loss": 0.25})
    cbs.on_test_end({"loss": 0.25})
    assert "2/2 [==============================]" in capsys.readouterr().out
    cbs.on_predict_begin()
    cbs.on_predict_batch_end(0, {"outputs": torch.zeros(3)})
    cbs.on_predict_batch_end(1, {"outputs": torch.zeros(3)})
    cbs.on_predict_end()
    out = capsys.readouterr().out
    assert "2/2 [==============================]" in out
    assert "outputs" not in out


def test_validation_inside_fit_is_silent(fakes, capsys):
    logger = C.ProgbarLogger()
    cbs = C.CallbackList([logger], model=fakes.Model(), verbose=1, epochs=1, steps=1)
    cbs.on_train_begin()
    cbs.on_test_begin()
    cbs.on_test_batch_end(0, {"loss": 0.5})
    cbs.on_test_end({"loss": 0.5})
    assert capsys.readouterr().out == ""
    cbs.on_train_end()


@pytest.mark.parametrize("verbose", ["auto", 1])
def test_auto_verbose_is_one(verbose):
    logger = C.ProgbarLogger()
    logger.set_params({"verbose": verbose, "epochs": 3, "steps": 7})
    assert (logger.verbose, logger.epochs, logger.target) == (1, 3, 7)


def test_evaluate_and_predict_show_a_bar_unless_verbose_is_0(capsys):
    model = phalanx.Model(torch.nn.Linear(3, 1))
    model.compile(optimizer="sgd", loss="mse")
    x, y = torch.randn(64, 3), torch.randn(64, 1)
    model.evaluate(x, y, batch_size=16, verbose=1)
    assert "4/4" in capsys.readouterr().out
    model.predict(x, batch_size=16)  # "auto" is 1
    assert "4/4" in capsys.readouterr().out
    model.evaluate(x, y, batch_size=16, verbose=0)
    model.predict(x, batch_size=16, verbose=0)
    model.test_on_batch(x, y)
    assert capsys.readouterr().out == ""
