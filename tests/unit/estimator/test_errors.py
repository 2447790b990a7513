"""Every error of phalanx.estimator that tests/unit/estimator/test_estimator.py does not raise."""

from __future__ import annotations

import json

import pytest
import torch

from phalanx.estimator import (
    DNNClassifier,
    Estimator,
    EstimatorSpec,
    LinearClassifier,
    RunConfig,
    get_module,
    numeric_column,
)

X, Y = torch.randn(8, 4), torch.zeros(8, dtype=torch.long)


def data():
    yield {"x": X}, Y


def test_spec_and_model_fn_errors(tmp_path):
    with pytest.raises(ValueError, match=r"mode is one of ModeKeys.TRAIN, EVAL, PREDICT. Received: 'serve'"):
        EstimatorSpec("serve")

    def not_a_module(features, labels, mode):
        get_module("net", lambda: "a string")

    with pytest.raises(TypeError, match="returns a torch.nn.Module. Received: str"):
        Estimator(not_a_module, str(tmp_path)).train(data, steps=1)


def test_train_and_input_errors(tmp_path):
    estimator = LinearClassifier([numeric_column("x", 4)], str(tmp_path))
    with pytest.raises(ValueError, match="Give steps or max_steps, not both"):
        estimator.train(data, steps=1, max_steps=1)
    with pytest.raises(TypeError, match=r"returns an iterable of \(features, labels\).*Received: int"):
        estimator.train(lambda: 3, steps=1)
    with pytest.raises(KeyError, match=r"no column 'x'. Received: keys \['y'\]"):
        estimator.train(lambda: [({"y": X}, Y)], steps=1)
    estimator.train(data, steps=1)
    with pytest.raises(ValueError, match="at least one batch. Received: an empty input_fn"):
        estimator.evaluate(lambda: [])


def test_canned_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="n_classes must be >= 2. Received: 1"):
        DNNClassifier([4], [numeric_column("x", 4)], n_classes=1)
    wrong = DNNClassifier([4], [numeric_column("x", 4)], str(tmp_path), optimizer=lambda params: "sgd")
    with pytest.raises(TypeError, match=r"optimizer\(params\) returns a torch optimizer. Received: str"):
        wrong.train(data, steps=1)


def test_tf1_master_is_refused_with_a_hint(monkeypatch):
    cluster = {"master": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "master", "index": 0}}))
    with pytest.raises(ValueError, match=r"unknown job 'master'.*TF1's 'master' is now 'chief'"):
        RunConfig()
