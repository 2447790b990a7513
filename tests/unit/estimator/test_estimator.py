"""phalanx.estimator locally: train/evaluate/predict/export of a model_fn, canned classifiers,
train_and_evaluate without TF_CONFIG, and the errors. The distributed roles run in
tests/multiprocess/test_estimator_cluster.py."""

from __future__ import annotations

import json
import os

import pytest
import torch

import phalanx
from phalanx.estimator import (
    DNNClassifier,
    Estimator,
    EstimatorSpec,
    EvalSpec,
    LinearClassifier,
    ModeKeys,
    RunConfig,
    TrainSpec,
    get_module,
    get_optimizer,
    numeric_column,
    train_and_evaluate,
)

G = torch.Generator().manual_seed(0)
X = torch.randn(256, 4, generator=G)
Y = (X[:, 0] + 0.5 * X[:, 1] > 0).long()
Y3 = (X[:, 0] > 0.5).long() + (X[:, 0] > -0.5).long()


def batches(labels=Y, repeat=100, size=32):
    def input_fn():
        for _ in range(repeat):
            for i in range(0, len(X), size):
                yield {"x": X[i : i + size]}, labels[i : i + size]

    return input_fn


def once(labels=Y):
    return batches(labels, repeat=1)


def model_fn(features, labels, mode, params):
    net = get_module("net", lambda: torch.nn.Linear(4, 2))
    logits = net(features["x"])
    predictions = {"class_ids": logits.argmax(1), "logits": logits}
    if mode == ModeKeys.PREDICT:
        return EstimatorSpec(mode, predictions=predictions)
    loss = torch.nn.functional.cross_entropy(logits, labels)
    if mode == ModeKeys.EVAL:
        accuracy = (predictions["class_ids"] == labels).float().mean()
        return EstimatorSpec(mode, loss=loss, eval_metric_ops={"accuracy": accuracy})
    optimizer = get_optimizer(lambda: torch.optim.SGD(net.parameters(), lr=params["lr"]))
    return EstimatorSpec(mode, loss=loss, train_op=optimizer)


def _estimator(tmp_path, **config):
    return Estimator(
        model_fn, str(tmp_path), RunConfig(save_checkpoints_steps=10, **config), params={"lr": 0.5}
    )


def test_train_evaluate_predict_and_export_a_model_fn(tmp_path):
    estimator = _estimator(tmp_path)
    estimator.train(batches(), steps=30)
    assert estimator.latest_checkpoint().endswith("model.ckpt-30.pt")
    estimator.train(batches(), steps=20)  # a new call restores and continues
    assert estimator.latest_checkpoint().endswith("model.ckpt-50.pt")
    result = estimator.evaluate(once())
    assert result["global_step"] == 50
    assert result["accuracy"] > 0.9
    assert set(result) == {"loss", "accuracy", "global_step"}
    assert list((tmp_path / "eval").glob("events.out.tfevents.*"))  # TensorBoard, as TF
    assert list(tmp_path.glob("events.out.tfevents.*"))  # the training loss
    predictions = list(estimator.predict(lambda: [{"x": X[:5]}]))
    assert len(predictions) == 5
    assert set(predictions[0]) == {"class_ids", "logits"}
    served = phalanx.saved_model.load(
        estimator.export_saved_model(str(tmp_path / "export"), lambda: {"x": X[:3]})
    )
    out = served(X[:7])  # the dict's tensors go positionally, in sorted key order; any batch size
    assert torch.equal(
        out["class_ids"], torch.stack([p["class_ids"] for p in estimator.predict(lambda: [{"x": X[:7]}])])
    )


def test_train_stops_at_max_steps_or_at_the_end_of_the_input(tmp_path):
    estimator = _estimator(tmp_path)
    estimator.train(batches(), max_steps=12)
    estimator.train(batches(), max_steps=12)  # nothing left to train
    assert estimator.latest_checkpoint().endswith("model.ckpt-12.pt")
    estimator.train(once())  # 8 batches, then the input ends
    assert estimator.latest_checkpoint().endswith("model.ckpt-20.pt")


@pytest.mark.parametrize("make", ["dnn", "linear", "dnn3"])
def test_canned_classifiers_learn(tmp_path, make):
    columns = [numeric_column("x", shape=4)]
    labels = Y3 if make == "dnn3" else Y
    if make == "linear":
        estimator = LinearClassifier(columns, model_dir=str(tmp_path))
    else:
        n_classes = 3 if make == "dnn3" else 2
        estimator = DNNClassifier(
            [16, 8], columns, str(tmp_path), n_classes=n_classes, optimizer="Adam", dropout=0.1
        )
    estimator.train(batches(labels), max_steps=200)
    result = estimator.evaluate(once(labels))
    assert result["accuracy"] > 0.9
    assert set(result) == {"loss", "accuracy", "average_loss", "global_step"}
    prediction = next(estimator.predict(lambda: [{"x": X[:2]}]))
    assert prediction["probabilities"].shape == (3 if make == "dnn3" else 2,)
    assert prediction["probabilities"].sum().item() == pytest.approx(1.0)


def test_train_and_evaluate_without_tf_config_trains_and_evaluates_locally(tmp_path):
    estimator = _estimator(tmp_path)
    result, exports = train_and_evaluate(
        estimator, TrainSpec(batches(), max_steps=40), EvalSpec(once(), steps=None, throttle_secs=0)
    )
    assert result["global_step"] == 40
    assert result["accuracy"] > 0.9
    assert exports == []


def test_run_config_reads_the_task_from_tf_config(monkeypatch):
    cluster = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"], "ps": ["127.0.0.1:4"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 1}}))
    config = RunConfig()
    assert (config.task_type, config.task_id, config.is_chief) == ("worker", 1, False)
    assert (config.num_worker_replicas, config.num_ps_replicas) == (3, 1)
    assert config.save_checkpoints_secs == 600.0
    monkeypatch.delenv("TF_CONFIG")
    assert (RunConfig().task_type, RunConfig().is_chief) == (None, True)


def test_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"mode 'train' needs train_op.*HINT"):
        EstimatorSpec(ModeKeys.TRAIN, loss=torch.tensor(1.0))
    with pytest.raises(ValueError, match="at most one of save_checkpoints_steps"):
        RunConfig(save_checkpoints_steps=1, save_checkpoints_secs=1)
    with pytest.raises(ValueError, match=r"not through a strategy.*HINT"):
        RunConfig(train_distribute=phalanx.get_strategy())
    with pytest.raises(RuntimeError, match="inside a model_fn that an Estimator runs"):
        get_module("net", lambda: torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match=r"Could not find a trained model.*HINT: call train\(\) first"):
        _estimator(tmp_path).evaluate(once())
    with pytest.raises(TypeError, match="returns a phalanx.estimator.EstimatorSpec. Received: dict"):
        Estimator(lambda features, labels, mode: {}, str(tmp_path)).train(batches(), steps=1)
    with pytest.raises(ValueError, match=r"numeric feature columns. Received: \['str'\]"):
        DNNClassifier([4], ["x"])
    with pytest.raises(ValueError, match="'Ftrl' has no torch counterpart"):
        LinearClassifier([numeric_column("x", 4)], str(tmp_path), optimizer="Ftrl").train(batches(), steps=1)


def test_a_model_fn_that_creates_a_module_on_a_later_call_is_refused(tmp_path):
    calls = []

    def growing(features, labels, mode):
        calls.append(1)
        net = get_module(f"net{len(calls)}", lambda: torch.nn.Linear(4, 2))
        loss = torch.nn.functional.cross_entropy(net(features["x"]), labels)
        return EstimatorSpec(
            mode, loss=loss, train_op=get_optimizer(lambda: torch.optim.SGD(net.parameters(), 0.1))
        )

    with pytest.raises(ValueError, match=r"a new 'net2' on a later call"):
        Estimator(growing, str(tmp_path)).train(batches(), steps=2)


def test_training_tasks_need_ps_and_other_tasks_are_pointed_to_train_and_evaluate(tmp_path, monkeypatch):
    cluster = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "chief", "index": 0}}))
    with pytest.raises(ValueError, match=r"cluster with 'ps' tasks.*Received: task chief:0"):
        _estimator(tmp_path).train(batches(), steps=1)
    monkeypatch.setenv(
        "TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "evaluator", "index": 0}})
    )
    estimator = _estimator(tmp_path)
    with pytest.raises(
        ValueError, match=r"task evaluator:0.*HINT: call phalanx.estimator.train_and_evaluate"
    ):
        estimator.train(batches(), steps=1)
    spec = EvalSpec(once(), start_delay_secs=0, throttle_secs=0, checkpoint_timeout_secs=0.3)
    with pytest.raises(TimeoutError, match=r"waited 0.3s for a new checkpoint.*HINT: the chief writes"):
        train_and_evaluate(estimator, TrainSpec(batches(), max_steps=5), spec)
    assert not os.listdir(tmp_path)
