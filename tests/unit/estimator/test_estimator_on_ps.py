"""An Estimator's chief task against a real ps server in this process (gRPC on 127.0.0.1):
its variables and optimizer state live on the ps task, its checkpoints restore across train()
calls and into a local evaluation. The full chief/worker/ps/evaluator cluster runs in
tests/multiprocess/test_estimator_cluster.py."""

from __future__ import annotations

import json

import pytest
import torch

from phalanx.cluster._ports import free_ports
from phalanx.estimator import DNNClassifier, RunConfig, numeric_column
from phalanx.security.token import TOKEN_ENV
from phalanx.server import Server

X = torch.randn(128, 4, generator=torch.Generator().manual_seed(0))
Y = (X[:, 0] - X[:, 2] > 0).long()


def input_fn():
    while True:
        for i in range(0, 128, 32):
            yield {"x": X[i : i + 32]}, Y[i : i + 32]


def eval_input_fn():
    yield {"x": X}, Y


@pytest.fixture
def chief_with_ps(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "test-secret-0123456789")
    chief, ps = (f"127.0.0.1:{port}" for port in free_ports(2))
    server = Server({"chief": [chief], "ps": [ps]}, "ps", 0)
    config = {"cluster": {"chief": [chief], "ps": [ps]}, "task": {"type": "chief", "index": 0}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    yield server
    server.stop()


def test_the_chief_trains_on_the_ps_task_and_restores_across_calls(chief_with_ps, tmp_path):
    estimator = DNNClassifier(
        [8],
        [numeric_column("x", 4)],
        str(tmp_path),
        optimizer="Adam",
        config=RunConfig(save_checkpoints_steps=10),
    )
    assert estimator.config.task_type == "chief"
    estimator.train(input_fn, max_steps=30)
    assert estimator.latest_checkpoint().endswith("model.ckpt-30.pt")
    first = estimator.evaluate(eval_input_fn)
    estimator.train(input_fn, max_steps=80)  # a new strategy and graph; the checkpoint restores
    assert estimator.latest_checkpoint().endswith("model.ckpt-80.pt")
    second = estimator.evaluate(eval_input_fn)
    assert (first["global_step"], second["global_step"]) == (30, 80)
    assert second["loss"] < first["loss"]
    assert second["accuracy"] > 0.9
    saved = torch.load(estimator.latest_checkpoint(), weights_only=False)["objects"]
    assert saved["optimizer.optimizer"]["state"]  # Adam's moments, read from the ps task
