"""SidecarEvaluator: evaluates each new checkpoint a training job writes (real files, fake clock)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import phalanx
from phalanx.checkpoint import Checkpoint, CheckpointManager


def _compiled():
    torch.manual_seed(0)
    model = phalanx.Model(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    model.compile(
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        loss=phalanx.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    return x, (x.sum(1) > 0).long()


class Trainer:
    """The training job: one epoch and one checkpoint each time the evaluator sleeps."""

    def __init__(self, directory, epochs):
        self.model = _compiled()
        self.manager = CheckpointManager(Checkpoint(model=self.model), directory, max_to_keep=2)
        self.epochs, self.expected, self.now = epochs, [], 0.0

    def sleep(self, seconds):
        self.now += seconds
        if self.epochs:
            self.epochs -= 1
            x, y = _data()
            self.model.fit(x, y, batch_size=16, epochs=1, verbose=0)
            self.expected.append(self.model.evaluate(x, y, verbose=0, return_dict=True))
            self.manager.save()


def test_each_new_checkpoint_is_evaluated_once_with_the_trained_weights(tmp_path):
    trainer = Trainer(str(tmp_path), epochs=3)
    evaluator = phalanx.SidecarEvaluator(
        _compiled(),
        data=_data(),
        checkpoint_dir=str(tmp_path),
        max_evaluations=3,
        clock=lambda: trainer.now,
        sleep=trainer.sleep,
    )
    results = evaluator.start()
    assert [r["checkpoint"].rsplit("-", 1)[1] for r in results] == ["1.pt", "2.pt", "3.pt"]
    for result, expected in zip(results, trainer.expected, strict=True):
        assert result["loss"] == pytest.approx(expected["loss"], rel=1e-6)
        assert result["accuracy"] == pytest.approx(expected["accuracy"])
    assert results[-1]["loss"] < results[0]["loss"]


def test_it_stops_when_no_new_checkpoint_comes_within_the_timeout(tmp_path, caplog):
    trainer = Trainer(str(tmp_path), epochs=1)
    evaluator = phalanx.SidecarEvaluator(
        _compiled(),
        data=_data(),
        checkpoint_dir=str(tmp_path),
        poll_seconds=5.0,
        timeout_seconds=30.0,
        clock=lambda: trainer.now,
        sleep=trainer.sleep,
    )
    with caplog.at_level(logging.WARNING, logger="phalanx"):
        results = evaluator.start()
    assert len(results) == 1
    assert "no new checkpoint" in caplog.text
    assert trainer.now >= 35.0


def test_waiting_is_logged(tmp_path, caplog, monkeypatch):
    from phalanx.keras import sidecar_evaluator

    monkeypatch.setattr(sidecar_evaluator, "LOG_EVERY_SECONDS", 10.0)
    trainer = Trainer(str(tmp_path), epochs=0)
    evaluator = phalanx.SidecarEvaluator(
        _compiled(),
        data=_data(),
        checkpoint_dir=str(tmp_path),
        timeout_seconds=25.0,
        poll_seconds=5.0,
        clock=lambda: trainer.now,
        sleep=trainer.sleep,
    )
    with caplog.at_level(logging.WARNING, logger="phalanx"):
        assert evaluator.start() == []
    assert "waiting for a new checkpoint" in caplog.text


def test_bad_arguments_are_refused(tmp_path):
    uncompiled = phalanx.Model(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="needs a compiled model"):
        phalanx.SidecarEvaluator(uncompiled, data=_data(), checkpoint_dir=str(tmp_path))
    with pytest.raises(ValueError, match="max_evaluations must be positive"):
        phalanx.SidecarEvaluator(_compiled(), data=_data(), checkpoint_dir=str(tmp_path), max_evaluations=0)
    with pytest.raises(ValueError, match="poll_seconds must be positive"):
        phalanx.SidecarEvaluator(_compiled(), data=_data(), checkpoint_dir=str(tmp_path), poll_seconds=0)
