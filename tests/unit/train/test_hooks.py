"""The session hooks on a local MonitoredTrainingSession: summaries read back from the event
files, step counting, checkpoint listeners, default saving, and the hooks' errors."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from phalanx.train import (
    CheckpointSaverListener,
    MonitoredTrainingSession,
    Scaffold,
    SessionRunHook,
    StopAtStepHook,
    SummarySaverHook,
    latest_checkpoint,
)
from phalanx.train.hooks import summary_writer

X, Y = torch.ones(4, 2), torch.zeros(4, 1)


def _model():
    model = torch.nn.Linear(2, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _step(model, optimizer):
    def fn():
        optimizer.zero_grad()
        loss = (model(X) - Y).pow(2).mean()
        loss.backward()
        optimizer.step()
        return {"loss": loss.detach(), "lr": 0.1, "not a scalar": torch.ones(3)}

    return fn


def _scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [e.step for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_summaries_every_n_steps_and_the_step_rate(tmp_path, caplog):
    model, optimizer = _model()
    hooks = [StopAtStepHook(num_steps=6)]
    with (
        caplog.at_level(logging.INFO, logger="phalanx"),
        MonitoredTrainingSession(
            checkpoint_dir=str(tmp_path),
            scaffold=Scaffold(model=model, optimizer=optimizer),
            hooks=hooks,
            save_summaries_steps=2,
            log_step_count_steps=3,
        ) as sess,
    ):
        while not sess.should_stop():
            sess.run(_step(model, optimizer))
    scalars = _scalars(tmp_path)
    assert scalars["loss"] == [1, 3, 5]  # the first step, then every 2 global steps
    assert scalars["lr"] == [1, 3, 5]
    assert "not a scalar" not in scalars
    assert scalars["global_step/sec"] == [3, 6]
    assert "global_step/sec:" in caplog.text
    assert latest_checkpoint(str(tmp_path)).endswith("model.ckpt-6.pt")  # at the end, by default


class _StopAfterSecondSave(CheckpointSaverListener):
    def __init__(self):
        self.calls = []

    def begin(self):
        self.calls.append("begin")

    def before_save(self, session, global_step):
        self.calls.append(f"before {global_step}")

    def after_save(self, session, global_step):
        self.calls.append(f"after {global_step}")
        return global_step >= 2

    def end(self, session, global_step):
        self.calls.append(f"end {global_step}")


def test_a_listener_sees_every_save_and_can_stop_training(tmp_path):
    model, optimizer = _model()
    listener = _StopAfterSecondSave()
    with MonitoredTrainingSession(
        checkpoint_dir=str(tmp_path),
        scaffold=Scaffold(model=model),
        save_checkpoint_steps=2,
        save_summaries_steps=None,
        saving_listeners=[listener],
    ) as sess:
        while not sess.should_stop():
            sess.run(_step(model, optimizer))
    assert sess.global_step == 2
    assert listener.calls == ["begin", "before 0", "after 0", "before 2", "after 2", "end 2"]


class _Recorder(SessionRunHook):
    def __init__(self):
        self.calls = []

    def begin(self):
        self.calls.append("begin")

    def after_create_session(self, session):
        self.calls.append("created")

    def before_run(self, run_context):
        self.calls.append("before")

    def after_run(self, run_context, run_values):
        self.calls.append(f"after {run_values.global_step}")
        if run_values.global_step == 2:
            run_context.request_stop()

    def end(self, session):
        self.calls.append("end")


def test_hook_order_and_chief_only_hooks(tmp_path):
    model, optimizer = _model()
    everyone, chief_only = _Recorder(), _Recorder()
    with MonitoredTrainingSession(
        is_chief=False, hooks=[everyone], chief_only_hooks=[chief_only], log_step_count_steps=None
    ) as sess:
        while not sess.should_stop():
            sess.run(_step(model, optimizer))
    assert everyone.calls == ["begin", "created", "before", "after 1", "before", "after 2", "end"]
    assert chief_only.calls == []  # not the chief


def test_an_error_in_a_step_skips_the_final_checkpoint(tmp_path):
    model, optimizer = _model()
    sess = MonitoredTrainingSession(
        checkpoint_dir=str(tmp_path), scaffold=Scaffold(model=model), save_checkpoint_steps=100
    )

    def fail_in_the_session():
        with sess:
            sess.run(_step(model, optimizer))
            sess.run(lambda: 1 / 0)

    with pytest.raises(ZeroDivisionError):
        fail_in_the_session()
    assert sess.should_stop()
    assert latest_checkpoint(str(tmp_path)).endswith("model.ckpt-0.pt")  # the start's only


def test_hook_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"Steps must be >= 0. Received: num_steps=-1"):
        StopAtStepHook(num_steps=-1)
    with pytest.raises(ValueError, match="exactly one of secs and steps"):
        SummarySaverHook(save_steps=1, save_secs=1.0, output_dir=str(tmp_path))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"need the tensorboard package. HINT: pip install"):
        summary_writer(str(tmp_path / "elsewhere"))
