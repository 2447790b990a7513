"""Callbacks that write files: CSVLogger, ModelCheckpoint, TensorBoard, and the chief-only rule."""

from __future__ import annotations

import csv
import os
import sys

import pytest
import torch
from torch import nn

from phalanx import callbacks as C
from phalanx.strategies.workers import distributed_files as files


def rows(path, delimiter=","):
    with open(path, newline="") as f:
        return list(csv.reader(f, delimiter=delimiter))


# ------------------------------------------------------------------ the chief-only rule
def test_write_filepath_chief_and_workers(tmp_path, fakes):
    target = str(tmp_path / "ckpt" / "model.pt")
    assert files.write_filepath(target, fakes.strategy(is_chief=True)) == target
    assert files.write_filepath(target, None) == target
    worker = fakes.strategy(is_chief=False, task_id=3)
    temp = files.write_filepath(target, worker)
    assert temp == str(tmp_path / "ckpt" / "workertemp_3" / "model.pt")
    assert os.path.isdir(os.path.dirname(temp))
    assert files.write_filepath(temp, worker) == temp  # already in the temp folder
    files.remove_temp_dir_with_filepath(temp, worker)
    assert not os.path.exists(os.path.dirname(temp))
    files.remove_temp_dirpath(str(tmp_path / "ckpt"), fakes.strategy(is_chief=True))  # nothing to do
    assert os.path.isdir(tmp_path / "ckpt")


def test_worker_without_a_cluster_uses_its_process_id(tmp_path, fakes):
    worker = fakes.strategy(is_chief=False, task_id=None)
    temp = files.write_filepath(str(tmp_path / "log.csv"), worker)
    assert os.path.basename(os.path.dirname(temp)) == f"workertemp_pid{os.getpid()}"
    files.remove_temp_dirpath(str(tmp_path), worker)
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ CSVLogger
def test_csv_logger_keras_layout(tmp_path, fakes):
    path = str(tmp_path / "log.csv")
    logs = [{"loss": 0.5, "accuracy": 0.25}, {"loss": 0.25, "accuracy": 0.5}]
    fakes.fit(fakes.Model(), [C.CSVLogger(path)], logs)
    assert rows(path) == [
        ["epoch", "accuracy", "loss", "val_accuracy", "val_loss"],
        ["0", "0.25", "0.5", "NA", "NA"],
        ["1", "0.5", "0.25", "NA", "NA"],
    ]
    fakes.fit(fakes.Model(), [C.CSVLogger(path)], logs[:1])  # overwrites
    assert len(rows(path)) == 2


def test_csv_logger_append_separator_and_values(tmp_path, fakes):
    path = str(tmp_path / "log.tsv")
    logger = C.CSVLogger(path, separator="\t", append=True)
    logs = [{"loss": torch.tensor(0.5), "val_loss": 0.75, "p": torch.tensor([0.25, 0.5]), "note": "ok"}]
    fakes.fit(fakes.Model(), [logger], logs)
    fakes.fit(fakes.Model(), [logger], logs)
    assert rows(path, "\t") == [
        ["epoch", "loss", "note", "p", "val_loss"],
        ["0", "0.5", "ok", "[0.25, 0.5]", "0.75"],
        ["0", "0.5", "ok", "[0.25, 0.5]", "0.75"],
    ]


def test_csv_logger_non_chief_writes_a_removed_copy(tmp_path, fakes):
    path = str(tmp_path / "log.csv")
    model = fakes.Model(strategy=fakes.strategy(is_chief=False, task_id=1))
    seen = []
    spy = C.LambdaCallback(on_epoch_end=lambda e, logs: seen.extend(os.listdir(tmp_path / "workertemp_1")))
    logger = C.CSVLogger(path)
    fakes.fit(model, [logger, spy], [{"loss": 1.0}])
    assert seen == ["log.csv"]  # it wrote, like the chief, elsewhere
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ ModelCheckpoint
def test_checkpoint_templates_and_best_only(tmp_path, fakes):
    template = str(tmp_path / "w-{epoch:02d}-{loss:.2f}.pt")
    model = fakes.Model()
    ckpt = C.ModelCheckpoint(template, monitor="loss", save_best_only=True, save_weights_only=True)
    fakes.fit(model, [ckpt], [{"loss": v} for v in (0.9, 0.7, 0.8, 0.6)])
    assert sorted(os.listdir(tmp_path)) == ["w-01-0.90.pt", "w-02-0.70.pt", "w-04-0.60.pt"]
    assert {kind for kind, _ in model.saved} == {"weights"}
    assert set(torch.load(tmp_path / "w-04-0.60.pt")) == set(model.state_dict())
    every = fakes.Model()
    fakes.fit(every, [C.ModelCheckpoint(str(tmp_path / "all" / "m{epoch}.pt"))], [{"loss": 1.0}] * 2)
    assert sorted(os.listdir(tmp_path / "all")) == ["m1.pt", "m2.pt"]
    assert {kind for kind, _ in every.saved} == {"model"}


def test_checkpoint_modes_and_initial_threshold(tmp_path, fakes):
    path = str(tmp_path / "best.pt")
    accuracy = fakes.Model()
    fakes.fit(
        accuracy,
        [C.ModelCheckpoint(path, monitor="val_accuracy", save_best_only=True)],
        [{"val_accuracy": v} for v in (0.5, 0.4, 0.6)],
    )
    assert len(accuracy.saved) == 2  # auto mode: higher is better
    threshold = fakes.Model()
    ckpt = C.ModelCheckpoint(path, monitor="loss", save_best_only=True, initial_value_threshold=0.5)
    fakes.fit(threshold, [ckpt], [{"loss": v} for v in (0.9, 0.6, 0.4)])
    assert len(threshold.saved) == 1
    assert ckpt.best == 0.4


def test_checkpoint_every_n_batches_across_epochs(tmp_path, fakes):
    model = fakes.Model()
    ckpt = C.ModelCheckpoint(str(tmp_path / "e{epoch}-b{batch}.pt"), save_freq=3)
    fakes.fit(model, [ckpt], [{"loss": 1.0}] * 3, steps=2)  # batches 1..6 overall
    assert sorted(os.listdir(tmp_path)) == ["e2-b1.pt", "e3-b2.pt"]


def test_checkpoint_verbose_and_missing_monitor(tmp_path, fakes, capsys):
    model = fakes.Model()
    ckpt = C.ModelCheckpoint(str(tmp_path / "m.pt"), monitor="loss", save_best_only=True, verbose=1)
    fakes.fit(model, [ckpt], [{"loss": 1.0}, {"loss": 2.0}])
    out = capsys.readouterr().out
    assert f"Epoch 1: loss improved from None to 1.00000, saving model to {tmp_path / 'm.pt'}" in out
    assert "Epoch 2: loss did not improve from 1.00000" in out
    plain = C.ModelCheckpoint(str(tmp_path / "p.pt"), verbose=1)
    fakes.fit(fakes.Model(), [plain], [{"loss": 1.0}])
    assert "Epoch 1: saving model to" in capsys.readouterr().out
    missing = fakes.Model()
    with pytest.warns(UserWarning, match="Can save best model only with val_loss available"):
        fakes.fit(missing, [C.ModelCheckpoint(str(tmp_path / "v.pt"), save_best_only=True)], [{"loss": 1.0}])
    assert len(missing.saved) == 1  # Keras 3 saves anyway


def test_checkpoint_non_chief_saves_to_a_removed_copy(tmp_path, fakes):
    model = fakes.Model(strategy=fakes.strategy(is_chief=False, task_id=2))
    fakes.fit(model, [C.ModelCheckpoint(str(tmp_path / "ckpt" / "m.pt"))], [{"loss": 1.0}])
    assert model.saved == [("model", str(tmp_path / "ckpt" / "workertemp_2" / "m.pt"))]  # every worker saves
    assert os.listdir(tmp_path / "ckpt") == []


def test_checkpoint_errors(tmp_path, fakes):
    with pytest.raises(ValueError, match="save_freq must be 'epoch' or a positive integer"):
        C.ModelCheckpoint("x", save_freq=0)
    with pytest.raises(ValueError, match="save_freq must be 'epoch' or a positive integer"):
        C.ModelCheckpoint("x", save_freq="often")
    with pytest.raises(ValueError, match="mode must be one of"):
        C.ModelCheckpoint("x", mode="best")
    with pytest.raises(KeyError, match="val_acc"):
        fakes.fit(fakes.Model(), [C.ModelCheckpoint(str(tmp_path / "{val_acc}.pt"))], [{"loss": 1.0}])


# ------------------------------------------------------------------ TensorBoard
def _event_files(folder):
    return [name for name in os.listdir(folder) if name.startswith("events.out.tfevents")]


def _scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {
        tag: [(e.step, round(e.value, 6)) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def test_tensorboard_writes_keras_layout(tmp_path, fakes):
    pytest.importorskip("tensorboard")
    logs = [{"loss": 0.5, "val_loss": 0.75}, {"loss": 0.25, "val_loss": 0.5}]
    fakes.fit(fakes.Model(), [C.TensorBoard(str(tmp_path), update_freq=3)], logs, steps=2)
    assert _scalars(tmp_path / "train") == {
        "epoch_loss": [(0, 0.5), (1, 0.25)],
        "batch_loss": [(3, 0.25)],
        "batch_val_loss": [(3, 0.5)],
    }
    assert _scalars(tmp_path / "validation") == {"epoch_loss": [(0, 0.75), (1, 0.5)]}
    every = tmp_path / "every"
    fakes.fit(fakes.Model(), [C.TensorBoard(str(every), update_freq="batch")], logs[:1], steps=2)
    assert _scalars(every / "train")["batch_loss"] == [(1, 0.5), (2, 0.5)]


def test_tensorboard_non_chief_writes_a_removed_copy(tmp_path, fakes):
    pytest.importorskip("tensorboard")
    seen = []
    spy = C.LambdaCallback(
        on_epoch_end=lambda e, logs: seen.extend(_event_files(tmp_path / "workertemp_1" / "tb" / "train"))
    )
    model = fakes.Model(strategy=fakes.strategy(is_chief=False, task_id=1))
    fakes.fit(model, [C.TensorBoard(str(tmp_path / "tb")), spy], [{"loss": 1.0}])
    assert len(seen) == 1
    assert os.listdir(tmp_path) == []


def test_tensorboard_without_the_extra_names_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails, as when missing
    with pytest.raises(ImportError, match=r"pip install 'phalanx\[tensorboard\]'"):
        C.TensorBoard("logs")


def test_tensorboard_errors():
    pytest.importorskip("tensorboard")
    with pytest.raises(ValueError, match="update_freq must be 'epoch', 'batch' or a positive integer"):
        C.TensorBoard("logs", update_freq=0)
    with pytest.raises(ValueError, match="update_freq must be"):
        C.TensorBoard("logs", update_freq="step")


def _histograms(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"histograms": 0})
    events.Reload()
    return {tag: [e.step for e in events.Histograms(tag)] for tag in events.Tags()["histograms"]}


def _keras_model(strategy):
    import phalanx

    with strategy.scope():
        model = phalanx.Model(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)))
        model.compile(optimizer="adam", loss="mse")
    return model


def test_tensorboard_weight_histograms_every_histogram_freq_epochs(tmp_path, mirrored_2cpu):
    pytest.importorskip("tensorboard")
    model = _keras_model(mirrored_2cpu)
    x, y = torch.randn(32, 4), torch.randn(32, 2)
    model.fit(
        x, y, batch_size=8, epochs=5, verbose=0, callbacks=[C.TensorBoard(str(tmp_path), histogram_freq=2)]
    )
    histograms = _histograms(tmp_path / "train")
    # Keras' rule: epochs 0, N, 2N, ...; every floating weight and buffer, named as the module names them.
    assert set(histograms) == {
        "0.weight",
        "0.bias",
        "1.weight",
        "1.bias",
        "1.running_mean",
        "1.running_var",
        "2.weight",
        "2.bias",
    }
    assert all(steps == [0, 2, 4] for steps in histograms.values())
    assert "epoch_loss" in _scalars(tmp_path / "train")


def test_tensorboard_profile_batch_writes_a_trace_the_profiler_plugin_reads(tmp_path, mirrored_2cpu):
    pytest.importorskip("tensorboard")
    import gzip
    import json

    model = _keras_model(mirrored_2cpu)
    x, y = torch.randn(64, 4), torch.randn(64, 2)
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        verbose=0,
        callbacks=[C.TensorBoard(str(tmp_path), profile_batch=(3, 5))],
    )
    runs = os.listdir(tmp_path / "train" / "plugins" / "profile")
    assert len(runs) == 1
    traces = os.listdir(tmp_path / "train" / "plugins" / "profile" / runs[0])
    assert len(traces) == 1
    assert traces[0].endswith(".pt.trace.json")  # torch-tb-profiler's suffix
    path = tmp_path / "train" / "plugins" / "profile" / runs[0] / traces[0]
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    assert any("aten::" in str(e.get("name")) for e in events)  # the traced batches' operators


def test_tensorboard_profile_stops_when_training_ends_first(tmp_path, one_device):
    pytest.importorskip("tensorboard")
    model = _keras_model(one_device)
    model.fit(
        torch.randn(16, 4),
        torch.randn(16, 2),
        batch_size=8,
        epochs=1,
        verbose=0,
        callbacks=[C.TensorBoard(str(tmp_path), profile_batch="2, 100")],
    )
    (run,) = os.listdir(tmp_path / "train" / "plugins" / "profile")
    assert len(os.listdir(tmp_path / "train" / "plugins" / "profile" / run)) == 1


def test_tensorboard_no_profile_no_histograms_by_default(tmp_path, one_device):
    pytest.importorskip("tensorboard")
    model = _keras_model(one_device)
    model.fit(
        torch.randn(16, 4),
        torch.randn(16, 2),
        batch_size=8,
        epochs=2,
        verbose=0,
        callbacks=[C.TensorBoard(str(tmp_path))],
    )
    assert os.listdir(tmp_path / "train") == _event_files(tmp_path / "train")
    assert _histograms(tmp_path / "train") == {}


@pytest.mark.parametrize(
    ("profile_batch", "expected"),
    [(0, None), (3, (3, 3)), ((2, 4), (2, 4)), ([1, 1], (1, 1)), ("10,20", (10, 20)), ("0,0", None)],
)
def test_profile_batch_spellings(profile_batch, expected):
    from phalanx.callbacks.tensorboard import parse_profile_batch

    assert parse_profile_batch(profile_batch) == expected


@pytest.mark.parametrize("profile_batch", [-1, (5, 2), (0, 3), "a,b", (1, 2, 3), True, 1.5])
def test_profile_batch_errors_name_the_form(profile_batch):
    pytest.importorskip("tensorboard")
    with pytest.raises(ValueError, match="profile_batch"):
        C.TensorBoard("logs", profile_batch=profile_batch)


@pytest.mark.parametrize("histogram_freq", [-1, 1.5, True, "1"])
def test_histogram_freq_errors(histogram_freq):
    pytest.importorskip("tensorboard")
    with pytest.raises(ValueError, match="histogram_freq must be an integer >= 0"):
        C.TensorBoard("logs", histogram_freq=histogram_freq)
