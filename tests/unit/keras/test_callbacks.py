"""phalanx.callbacks: the base, CallbackList, History, EarlyStopping, learning rates, NaN, lambdas."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from torch import nn

import phalanx
from phalanx import callbacks as C
from phalanx import metrics as M


class Recorder(C.Callback):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __getattribute__(self, name):
        if name.startswith("on_"):
            return lambda *a, **k: object.__getattribute__(self, "calls").append(name)
        return object.__getattribute__(self, name)


def test_every_hook_is_a_no_op_and_batch_aliases_forward():
    seen = []

    class Old(C.Callback):  # a Keras 2 style callback overriding on_batch_*
        def on_batch_begin(self, batch, logs=None):
            seen.append(("begin", batch))

        def on_batch_end(self, batch, logs=None):
            seen.append(("end", batch))

    base = C.Callback()
    for name in [n for n in vars(C.Callback) if n.startswith("on_")]:
        hook = getattr(base, name)
        assert (hook(0) if "batch" in name or "epoch" in name else hook()) is None
    old = Old()
    old.on_train_batch_begin(3)
    old.on_train_batch_end(3, {"loss": 1.0})
    assert seen == [("begin", 3), ("end", 3)]


def test_callback_list_dispatches_in_order_with_model_and_params(fakes):
    first, second = Recorder(), Recorder()
    model = fakes.Model()
    cbs = C.CallbackList([first, second], model=model, verbose=0, epochs=3, steps=5)
    assert first.model is model
    assert second.params == {"verbose": 0, "epochs": 3, "steps": 5}
    cbs.on_epoch_begin(0)
    cbs.on_train_batch_end(1, {})
    cbs.on_predict_end()
    assert first.calls == second.calls == ["on_epoch_begin", "on_train_batch_end", "on_predict_end"]
    third = Recorder()
    cbs.append(third)
    cbs.on_test_begin()
    assert third.calls == ["on_test_begin"]


def test_callback_list_adds_history_then_progbar_once():
    cbs = C.CallbackList([], add_history=True, add_progbar=True)
    assert [type(c) for c in cbs.callbacks] == [C.History, C.ProgbarLogger]
    mine = C.History()
    assert C.CallbackList([mine], add_history=True).callbacks == [mine]


def test_history_records_epochs_and_sets_model_history(fakes):
    model = fakes.Model()
    history = fakes.fit(model, [], [{"loss": 1.0, "val_loss": 2.0}, {"loss": 0.5, "val_loss": 1.5}])
    assert model.history is history
    assert history.epoch == [0, 1]
    assert history.history == {"loss": [1.0, 0.5], "val_loss": [2.0, 1.5]}


def test_hooks_run_in_fit_order(fakes):
    rec = Recorder()
    fakes.fit(fakes.Model(), [rec], [{"loss": 1.0}] * 2, steps=2)
    assert rec.calls[0] == "on_train_begin"
    assert rec.calls[-1] == "on_train_end"
    assert rec.calls[1:6] == [
        "on_epoch_begin",
        "on_train_batch_begin",
        "on_train_batch_end",
        "on_train_batch_begin",
        "on_train_batch_end",
    ]
    assert rec.calls.count("on_epoch_end") == 2


def losses(*values):
    return [{"loss": v} for v in values]


def epochs_run(fakes, callback, logs, **kwargs):
    return len(fakes.fit(fakes.Model(**kwargs), [callback], logs).epoch)


def test_early_stopping_patience_like_keras(fakes):
    # best 8 at epoch 2; epochs 3, 4, 5 do not beat it: the third miss stops training
    assert (
        epochs_run(fakes, C.EarlyStopping(monitor="loss", patience=3), losses(10, 9, 8, 9, 8.9, 8.7, 8.6))
        == 6
    )
    assert epochs_run(fakes, C.EarlyStopping(monitor="loss"), losses(3, 4, 1)) == 2  # patience 0
    assert epochs_run(fakes, C.EarlyStopping(monitor="loss", patience=1), losses(3, 2, 1, 0)) == 4


def test_early_stopping_min_delta_demands_a_real_improvement(fakes):
    small_steps = losses(1.0, 0.95, 0.9, 0.85)
    assert epochs_run(fakes, C.EarlyStopping(monitor="loss", min_delta=0.1), small_steps) == 2
    assert epochs_run(fakes, C.EarlyStopping(monitor="loss", min_delta=0.01), small_steps) == 4
    rising = [{"acc": v} for v in (0.5, 0.55, 0.58)]
    assert epochs_run(fakes, C.EarlyStopping(monitor="acc", min_delta=0.1), rising) == 2
    assert epochs_run(fakes, C.EarlyStopping(monitor="acc", min_delta=0.01), rising) == 3


def test_early_stopping_baseline_and_warm_up(fakes):
    # improvements that do not beat the baseline do not reset the wait
    stop = C.EarlyStopping(monitor="loss", patience=2, baseline=0.5)
    assert epochs_run(fakes, stop, losses(3, 2, 2.5, 2.5, 2.5)) == 3
    assert stop.stopped_epoch == 2
    assert epochs_run(fakes, C.EarlyStopping(monitor="loss", patience=2), losses(3, 2, 2.5, 2.5, 2.5)) == 4
    beaten = C.EarlyStopping(monitor="loss", patience=2, baseline=2.1)
    assert epochs_run(fakes, beaten, losses(3, 2, 2.5, 2.5, 2.5)) == 4
    late = C.EarlyStopping(monitor="loss", start_from_epoch=3)
    assert epochs_run(fakes, late, losses(1, 2, 3, 4, 5, 6)) == 5


def test_early_stopping_mode_from_the_models_metrics(fakes):
    stop = C.EarlyStopping(monitor="val_hits", patience=0)
    model = fakes.Model(metrics=[M.MeanMetricWrapper(lambda t, p: t == p, name="hits")])
    with pytest.raises(ValueError, match="cannot tell whether monitor='val_hits'"):
        fakes.fit(model, [stop], [{"val_hits": 1.0}] * 3)
    accuracy = M.Accuracy(name="hits")  # knows higher is better
    model = fakes.Model(metrics=[accuracy])
    assert len(fakes.fit(model, [stop], [{"val_hits": v} for v in (0.1, 0.2, 0.3)]).epoch) == 3
    assert (
        len(
            fakes.fit(
                model,
                [C.EarlyStopping(monitor="val_hits", mode="min")],
                [{"val_hits": v} for v in (0.1, 0.2, 0.3)],
            ).epoch
        )
        == 2
    )
    regression = fakes.Model(metrics=[M.MeanAbsoluteError(name="err")])
    assert (
        len(fakes.fit(regression, [C.EarlyStopping(monitor="err")], [{"err": v} for v in (3, 2, 1)]).epoch)
        == 3
    )


def test_restore_best_weights_loads_a_cpu_copy_at_the_end(fakes):
    def train(model, epoch):
        with torch.no_grad():
            model.linear.weight.fill_(float(epoch))

    stop = C.EarlyStopping(monitor="loss", patience=2, restore_best_weights=True, verbose=1)
    model = fakes.Model()
    history = fakes.fit(model, [stop], losses(5, 1, 3, 4, 0.5), train=train)
    assert history.epoch == [0, 1, 2, 3]
    assert stop.best_epoch == 1
    assert torch.all(model.linear.weight == 1.0)
    assert all(t.device.type == "cpu" for t in stop.best_weights.values())
    # without stopping early, the best epoch's weights come back too (Keras 3)
    stop = C.EarlyStopping(monitor="loss", patience=10, restore_best_weights=True)
    model = fakes.Model()
    fakes.fit(model, [stop], losses(5, 1, 3), train=train)
    assert torch.all(model.linear.weight == 1.0)


def test_early_stopping_prints_on_the_chief_only(fakes, capsys):
    stop = C.EarlyStopping(monitor="loss", verbose=1)
    fakes.fit(fakes.Model(), [stop], losses(1, 2))
    assert "Epoch 2: early stopping" in capsys.readouterr().out
    fakes.fit(fakes.Model(strategy=fakes.strategy(is_chief=False)), [stop], losses(1, 2))
    assert capsys.readouterr().out == ""


def test_missing_monitor_warns(fakes):
    with pytest.warns(
        UserWarning, match="conditioned on `val_loss`, which is not in the logs. Available: loss"
    ):
        fakes.fit(fakes.Model(), [C.EarlyStopping()], losses(1, 2))
    with pytest.warns(UserWarning, match="Learning rate reduction is conditioned on `val_loss`"):
        fakes.fit(fakes.Model(), [C.ReduceLROnPlateau()], losses(1))


def test_learning_rate_scheduler_sets_every_group_and_logs(fakes):
    model = fakes.Model(lr=0.1)
    model.optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 7.0})
    history = fakes.fit(
        model, [C.LearningRateScheduler(lambda epoch, lr: 0.1 / (epoch + 1))], losses(1, 1, 1)
    )
    assert history.history["learning_rate"] == pytest.approx([0.1, 0.05, 0.1 / 3])
    assert [g["lr"] for g in model.optimizer.param_groups] == pytest.approx([0.1 / 3] * 2)
    old_api = fakes.Model()
    fakes.fit(old_api, [C.LearningRateScheduler(lambda epoch: 0.5**epoch)], losses(1, 1))
    assert old_api.optimizer.param_groups[0]["lr"] == 0.5


def test_learning_rate_scheduler_tensor_rates_and_verbose(fakes, capsys):
    model = fakes.Model()
    model.optimizer = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))
    lr_object = model.optimizer.param_groups[0]["lr"]
    fakes.fit(model, [C.LearningRateScheduler(lambda e, lr: torch.tensor(lr * 2), verbose=1)], losses(1, 1))
    assert model.optimizer.param_groups[0]["lr"] is lr_object  # filled in place
    assert lr_object.item() == pytest.approx(0.04)
    assert "Epoch 2: LearningRateScheduler setting learning rate to 0.0399999" in capsys.readouterr().out


def test_reduce_lr_on_plateau_keras_rules(fakes):
    model = fakes.Model(lr=1.0)
    plateau = C.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=1, cooldown=2, min_lr=0.2)
    history = fakes.fit(model, [plateau], losses(1, 1, 1, 1, 1, 1, 1))
    # reductions at the end of epochs 1, 3 and 5 (the cooldown skips one epoch), floored at min_lr
    assert history.history["learning_rate"] == pytest.approx([1.0, 1.0, 0.5, 0.5, 0.25, 0.25, 0.2])
    improving = fakes.Model(lr=1.0)
    fakes.fit(improving, [C.ReduceLROnPlateau(monitor="loss", patience=0)], losses(3, 2, 1))
    assert improving.optimizer.param_groups[0]["lr"] == 1.0
    small = fakes.Model(lr=1.0)
    fakes.fit(
        small, [C.ReduceLROnPlateau(monitor="loss", patience=0, min_delta=0.5, verbose=1)], losses(3, 2.9)
    )
    assert small.optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
    maximise = fakes.Model(lr=1.0)
    fakes.fit(
        maximise,
        [C.ReduceLROnPlateau(monitor="val_accuracy", patience=0)],
        [{"val_accuracy": 0.9}, {"val_accuracy": 0.8}],
    )
    assert maximise.optimizer.param_groups[0]["lr"] == pytest.approx(0.1)


def test_terminate_on_nan(fakes, capsys):
    def batches(epoch, batch):
        return {"loss": float("nan") if (epoch, batch) == (1, 0) else 1.0}

    history = fakes.fit(fakes.Model(), [C.TerminateOnNaN()], losses(1, 1, 1), steps=3, batch_logs=batches)
    assert history.epoch == [0, 1]
    assert "Batch 0: Invalid loss, terminating training" in capsys.readouterr().out
    inf = fakes.fit(
        fakes.Model(), [C.TerminateOnNaN()], losses(1, 1), batch_logs=lambda e, b: {"loss": float("inf")}
    )
    assert inf.epoch == [0]


def test_lambda_callback(fakes):
    seen = []
    callback = C.LambdaCallback(
        on_epoch_end=lambda epoch, logs: seen.append(("epoch", epoch, logs["loss"])),
        on_train_begin=lambda logs: seen.append("begin"),
        on_test_end=lambda logs: seen.append("test"),
    )
    fakes.fit(fakes.Model(), [callback], losses(3, 2))
    callback.on_test_end({})
    assert seen == ["begin", ("epoch", 0, 3), ("epoch", 1, 2), "test"]


def test_callback_errors(fakes):
    with pytest.raises(TypeError, match="must be phalanx.callbacks.Callback instances"):
        C.CallbackList([object()])
    with pytest.raises(TypeError, match="must be phalanx.callbacks.Callback instances"):
        C.CallbackList().append(lambda: None)
    with pytest.raises(ValueError, match=r"unknown hook names \['on_nothing'\]"):
        C.LambdaCallback(on_nothing=lambda: None)
    with pytest.raises(ValueError, match="mode must be one of"):
        C.EarlyStopping(mode="up")
    with pytest.raises(ValueError, match="mode must be one of"):
        C.ReduceLROnPlateau(mode="down")
    with pytest.raises(ValueError, match="does not support a factor >= 1.0"):
        C.ReduceLROnPlateau(factor=2.0)
    with pytest.raises(ValueError, match="must return a finite number"):
        fakes.fit(fakes.Model(), [C.LearningRateScheduler(lambda e, lr: "x")], losses(1))
    with pytest.raises(ValueError, match="must return a finite number"):
        fakes.fit(fakes.Model(), [C.LearningRateScheduler(lambda e, lr: float("nan"))], losses(1))
    no_optimizer = fakes.Model()
    no_optimizer.optimizer = None
    with pytest.raises(ValueError, match="needs model.optimizer to be a torch.optim.Optimizer"):
        fakes.fit(no_optimizer, [C.LearningRateScheduler(lambda e, lr: lr)], losses(1))
    with pytest.raises(ValueError, match="ReduceLROnPlateau needs model.optimizer"):
        fakes.fit(no_optimizer, [C.ReduceLROnPlateau(monitor="loss")], losses(1))
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        C.Nope  # noqa: B018


def test_backup_and_restore_is_reachable_lazily():
    assert C.BackupAndRestore.__name__ == "BackupAndRestore"
    assert issubclass(C.BackupAndRestore, C.Callback)


class _Interrupted(Exception):
    pass


def _backed_up_fit(strategy, backup_dir, stop_at=None):
    """fit for 3 epochs of 4 batches with a backup every 2 batches; ``stop_at=(epoch, batch)``
    raises after that batch (its backup written). Returns the model and the (epoch, batch)
    pairs the run trained."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)
    with strategy.scope():
        model = phalanx.Model(nn.Linear(4, 1))
        model.compile(optimizer="sgd", loss="mse")
    seen, epoch = [], [0]

    def batch_end(batch, logs):
        seen.append((epoch[0], batch))
        if (epoch[0], batch) == stop_at:
            raise _Interrupted

    watch = C.LambdaCallback(
        on_epoch_begin=lambda e, logs: epoch.__setitem__(0, e), on_train_batch_end=batch_end
    )
    backup = C.BackupAndRestore(backup_dir, save_freq=2)
    with contextlib.suppress(_Interrupted):
        model.fit(x, y, batch_size=8, epochs=3, verbose=0, shuffle=False, callbacks=[backup, watch])
    return model, seen


def test_backup_and_restore_resumes_fit_after_the_last_batch_backed_up(tmp_path, one_device):
    reference, _ = _backed_up_fit(one_device, str(tmp_path / "reference"))
    _, first = _backed_up_fit(one_device, str(tmp_path / "run"), stop_at=(1, 1))
    assert first[-1] == (1, 1)  # the backup after batch 1 of epoch 1 was the last one written
    resumed, second = _backed_up_fit(one_device, str(tmp_path / "run"))
    assert second[0] == (1, 2)  # fit continued right after it, in epoch 1
    assert second[-1] == (2, 3)
    for ours, theirs in zip(resumed.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
