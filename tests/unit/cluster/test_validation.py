"""The catalogue of bad TF_CONFIGs: each one fails at start with a message naming the field."""

from __future__ import annotations

import json

import pytest

from phalanx.cluster import ClusterSpec, SimpleClusterResolver, TFConfigClusterResolver
from phalanx.cluster.validation import parse_tf_config, validate, validate_for_strategy

W2 = {"worker": ["a:1", "a:2"]}


def _config(cluster=None, task=None, **extra):
    config = {"cluster": cluster if cluster is not None else W2, **extra}
    if task is not None:
        config["task"] = task
    return json.dumps(config)


CATALOGUE = [
    # (id, TF_CONFIG, regex the message must match)
    (
        "malformed-json",
        '{"cluster": {"worker": ["a:1"]},}',
        r"not valid JSON: Expecting property name .* at line 1 column 33 \(char 32\)",
    ),
    (
        "malformed-json-caret",
        '{\n  "cluster": [}',
        r'line 2 column 15 \(char 16\):\n {6}"cluster": \[}\n {18}\^\n',
    ),  # the caret sits under the error
    ("not-an-object", '["a:1"]', r"must be a JSON object .* Received: '\[\"a:1\"\]' \(a JSON list\)"),
    (
        "no-cluster",
        '{"task": {"type": "worker", "index": 0}}',
        r"has no 'cluster' field. Received keys: \['task'\]",
    ),
    ("cluster-not-object", '{"cluster": ["a:1"]}', r"'cluster' must be an object of job name -> list"),
    (
        "cluster-bad-entry",
        _config({"worker": [5]}),
        r"'cluster' is invalid: cluster\['worker'\]\[0\] must be",
    ),
    ("no-task-for-two", _config(), r"'cluster' has 2 tasks but no 'task' says which one this process is"),
    ("task-not-object", _config(task="worker"), r"'task' must be an object with 'type' and 'index'"),
    ("task-no-type", _config(task={"index": 0}), r"'task' has no 'type'"),
    ("task-no-index", _config(task={"type": "worker"}), r"'task' has no 'index'"),
    (
        "task-type-not-str",
        _config(task={"type": 1, "index": 0}),
        r"'task' type must be a string. Received: 1",
    ),
    (
        "unknown-task-type",
        _config(task={"type": "boss", "index": 0}),
        r"'task' type 'boss' is unknown. Allowed types: chief, worker, ps, evaluator",
    ),
    (
        "unknown-job",
        _config({"master": ["a:1"]}, {"type": "chief", "index": 0}),
        r"unknown job 'master'. Allowed jobs: chief, worker, ps, evaluator. .*'master' is now 'chief'",
    ),
    (
        "task-type-not-in-cluster",
        _config(task={"type": "chief", "index": 0}),
        r"'task' type 'chief' is not a job of the 'cluster' \(its jobs: \['worker'\]\)",
    ),
    (
        "index-out-of-range",
        _config(task={"type": "worker", "index": 2}),
        r"'task' index 2 is out of range: job 'worker' has 2 task\(s\), with indices \[0, 1\]",
    ),
    ("negative-index", _config(task={"type": "worker", "index": -1}), r"non-negative integer. Received: -1"),
    ("string-index", _config(task={"type": "worker", "index": "1"}), r"non-negative integer. Received: '1'"),
    ("bool-index", _config(task={"type": "worker", "index": True}), r"non-negative integer. Received: True"),
    (
        "duplicate-address",
        _config({"worker": ["a:1"], "ps": ["a:1"]}, {"type": "worker", "index": 0}),
        r"gives the address 'a:1' to both ps:0 and worker:0",
    ),
    (
        "two-chiefs",
        _config({"chief": ["a:1", "a:2"]}, {"type": "chief", "index": 0}),
        r"has 2 'chief' tasks; at most one chief is allowed. Received: \['a:1', 'a:2'\]",
    ),
    (
        "two-evaluators",
        _config({"worker": ["a:1"], "evaluator": ["a:2", "a:3"]}, {"type": "worker", "index": 0}),
        r"has 2 'evaluator' tasks; at most one evaluator",
    ),
    (
        "empty-job",
        _config({"worker": ["a:1"], "ps": []}, {"type": "worker", "index": 0}),
        r"job 'ps' has no tasks",
    ),
    (
        "address-without-port",
        _config({"worker": ["a"]}, {"type": "worker", "index": 0}),
        r"'cluster' worker:0: A task address must be 'host:port' .* Received: 'a'",
    ),
    (
        "port-out-of-range",
        _config({"worker": ["a:70000"]}, {"type": "worker", "index": 0}),
        r"port in 0..65535. Received: 'a:70000'",
    ),
    (
        "rpc-layer-not-str",
        _config(task={"type": "worker", "index": 0}, rpc_layer=3),
        r"'rpc_layer' must be a string",
    ),
]


@pytest.mark.parametrize(("tf_config", "message"), [c[1:] for c in CATALOGUE], ids=[c[0] for c in CATALOGUE])
def test_bad_tf_config_catalogue(monkeypatch, tf_config, message):
    monkeypatch.setenv("TF_CONFIG", tf_config)
    with pytest.raises(ValueError, match=message) as raised:
        TFConfigClusterResolver()
    assert str(raised.value).startswith("TF_CONFIG")


def test_messages_carry_a_hint_where_a_fix_is_not_obvious(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", _config())
    with pytest.raises(ValueError, match='HINT: add "task": {"type": "worker", "index": 0}'):
        TFConfigClusterResolver()


def test_an_evaluator_need_not_be_listed_in_the_cluster():
    resolver = TFConfigClusterResolver(tf_config=_config(task={"type": "evaluator", "index": 0}))
    assert resolver.task_type == "evaluator"
    assert not resolver.is_chief


def test_blank_config_is_a_single_process():
    config = parse_tf_config("  ")
    assert (config.cluster, config.task_type, config.task_id) == (ClusterSpec({}), None, None)


def test_validate_without_require_task_accepts_a_cluster_without_task():
    validate(ClusterSpec(W2), None, None, "SimpleClusterResolver", require_task=False)
    with pytest.raises(ValueError, match="^SimpleClusterResolver 'task' type None is unknown"):
        validate(ClusterSpec(W2), None, 0, "SimpleClusterResolver")


def test_ps_job_rejected_by_strategies_without_parameter_servers():
    cluster = {"worker": ["a:1", "a:2"], "ps": ["a:3"]}
    resolver = TFConfigClusterResolver(tf_config=_config(cluster, {"type": "worker", "index": 0}))
    with pytest.raises(
        ValueError,
        match=r"^MultiWorkerMirroredStrategy does not use parameter servers, but TF_CONFIG's cluster has a "
        r"'ps' job with 1 task\(s\): \['a:3'\]\. HINT: use ParameterServerStrategy, or remove 'ps'",
    ):
        validate_for_strategy(resolver, "MultiWorkerMirroredStrategy", allow_ps=False)
    with pytest.raises(ValueError, match="but the cluster has a 'ps' job"):
        validate_for_strategy(ClusterSpec(cluster), "MultiWorkerMirroredStrategy", allow_ps=False)
    validate_for_strategy(resolver, "ParameterServerStrategy", allow_ps=True)
    validate_for_strategy(SimpleClusterResolver(W2), "MultiWorkerMirroredStrategy", allow_ps=False)
