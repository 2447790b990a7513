"""fit makes a step's global logs (a cross-worker sum of the metrics) only when a callback reads them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import phalanx
from phalanx import callbacks as C


class Counting(phalanx.Model):
    """A model that counts how often fit asks for its global logs."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        self.results = 0

    def get_metrics_result(self) -> dict[str, float]:
        self.results += 1
        return super().get_metrics_result()


def _fit(callbacks: list[C.Callback], verbose: int, steps: int = 5, epochs: int = 2) -> Counting:
    torch.manual_seed(0)
    model = Counting(nn.Linear(4, 3))
    model.compile(
        optimizer="sgd",
        loss=phalanx.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    x, y = torch.randn(8 * steps, 4), torch.randint(0, 3, (8 * steps,))
    model.fit(x, y, batch_size=8, epochs=epochs, verbose=verbose, callbacks=callbacks)
    return model


class _ReadsEachStep(C.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict] = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(dict(logs))


def test_without_a_reader_the_logs_are_made_once_an_epoch_and_history_is_unchanged():
    quiet = _fit([], verbose=0)
    assert quiet.results == 2  # one per epoch: its end
    reader = _ReadsEachStep()
    loud = _fit([reader], verbose=0)
    assert loud.results == 2 * 5  # every step (the last one's logs are the epoch's)
    assert [set(logs) for logs in reader.seen] == [{"loss", "accuracy"}] * 10
    assert quiet.history.history == loud.history.history


def test_epoch_callbacks_and_batch_hooks_that_read_nothing_get_empty_logs():
    seen = []
    quiet = _fit([C.LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append(logs["loss"]))], verbose=2)
    assert quiet.results == 2
    assert len(seen) == 2
    assert all(loss > 0 for loss in seen)


@pytest.mark.parametrize(
    ("callback", "reads"),
    [
        (C.Callback(), False),
        (C.History(), False),
        (C.EarlyStopping(), False),
        (C.LambdaCallback(on_epoch_end=lambda epoch, logs: None), False),
        (C.LambdaCallback(on_train_batch_end=lambda batch, logs: None), True),
        (C.LambdaCallback(on_batch_end=lambda batch, logs: None), True),
        (C.TerminateOnNaN(), True),
        (_ReadsEachStep(), True),
        (C.ModelCheckpoint("m.pt"), False),
        (C.ModelCheckpoint("m.pt", save_freq=3), True),
        (C.BackupAndRestore("backup", save_freq=3), False),
        (C.TensorBoard("logs"), False),
        (C.TensorBoard("logs", update_freq=2), True),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, C.Callback) else str(value),
)
def test_which_callbacks_read_batch_logs(callback, reads):
    assert callback.reads_batch_logs() is reads
    assert C.CallbackList([C.History(), callback]).reads_batch_logs() is reads


@pytest.mark.parametrize(("verbose", "reads"), [(1, True), ("auto", True), (2, False), (0, False)])
def test_the_progress_bar_reads_every_step_only_as_a_live_bar(verbose, reads):
    bar = C.ProgbarLogger()
    bar.set_params({"verbose": verbose, "epochs": 1, "steps": 3})
    assert bar.reads_batch_logs() is reads


def test_evaluate_makes_a_step_s_logs_only_for_a_reader():
    model = _fit([], verbose=0, epochs=1)
    x, y = torch.randn(40, 4), torch.randint(0, 3, (40,))
    model.results = 0
    quiet = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    assert model.results == 1  # the pass's end
    seen = []
    model.results = 0
    read = model.evaluate(
        x,
        y,
        batch_size=8,
        verbose=0,
        return_dict=True,
        callbacks=[C.LambdaCallback(on_test_batch_end=lambda batch, logs: seen.append(set(logs)))],
    )
    assert model.results == 5 + 1
    assert seen == [{"loss", "accuracy"}] * 5
    assert read == quiet


@pytest.mark.parametrize(
    ("callback", "train", "test"),
    [
        (C.LambdaCallback(on_test_batch_end=lambda batch, logs: None), False, True),
        (C.ModelCheckpoint("m.pt", save_freq=3), True, False),
        (C.TerminateOnNaN(), True, False),
    ],
    ids=["lambda-test", "checkpoint", "nan"],
)
def test_training_and_evaluation_readers_are_told_apart(callback, train, test):
    assert callback.reads_batch_logs("train") is train
    assert callback.reads_batch_logs("test") is test


def test_a_live_bar_inside_fit_reads_no_validation_logs():
    bar = C.ProgbarLogger()
    bar.set_params({"verbose": 1, "epochs": 1, "steps": 3})
    assert bar.reads_batch_logs("test")  # evaluate's own bar
    bar.on_train_begin()
    assert not bar.reads_batch_logs("test")  # fit's validation is silent


@pytest.mark.parametrize("callback", [C.Callback(), C.ProgbarLogger(), C.BackupAndRestore("b")])
def test_an_unknown_mode_is_refused(callback):
    with pytest.raises(ValueError, match='mode "train" or "test"'):
        callback.reads_batch_logs("predict")
