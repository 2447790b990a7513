"""TFConfigClusterResolver: reads TF_CONFIG at creation, arguments override its fields."""

from __future__ import annotations

import json

import pytest

from phalanx.cluster import TFConfigClusterResolver

CLUSTER = {"chief": ["h:1"], "worker": ["h:2", "h:3"], "ps": ["h:4"]}


def _set(monkeypatch, **config):
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))


def test_reads_cluster_task_rpc_layer_and_environment(monkeypatch):
    _set(
        monkeypatch,
        cluster=CLUSTER,
        task={"type": "worker", "index": 1},
        rpc_layer="grpc",
        environment="cloud",
    )
    resolver = TFConfigClusterResolver()
    assert resolver.cluster_spec().as_dict() == CLUSTER
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("worker", 1, "grpc")
    assert resolver.environment == "cloud"
    assert resolver.master() == "grpc://h:3"
    assert (resolver.rank, resolver.world_size, resolver.is_chief) == (2, 3, False)
    assert resolver.chief_address() == "h:1"


def test_read_at_creation_not_later(monkeypatch):
    _set(monkeypatch, cluster={"worker": ["a:1"]}, task={"type": "worker", "index": 0})
    resolver = TFConfigClusterResolver()
    monkeypatch.setenv("TF_CONFIG", "not json at all")
    assert resolver.cluster_spec().as_dict() == {"worker": ["a:1"]}


def test_arguments_override_the_config(monkeypatch):
    _set(monkeypatch, cluster=CLUSTER, task={"type": "worker", "index": 0}, rpc_layer="grpc")
    resolver = TFConfigClusterResolver(task_type="ps", task_id=0, rpc_layer="http", environment="local")
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer, resolver.environment) == (
        "ps",
        0,
        "http",
        "local",
    )
    with pytest.raises(ValueError, match="'task' index 4 is out of range"):
        TFConfigClusterResolver(task_id=4)


def test_explicit_json_instead_of_the_environment():
    resolver = TFConfigClusterResolver(tf_config=json.dumps({"cluster": {"worker": ["a:1"]}}))
    assert resolver.task_type is None
    assert resolver.is_chief  # one task: it is this process


def test_unset_means_a_single_process():
    resolver = TFConfigClusterResolver()
    assert not resolver.cluster_spec()
    assert (resolver.master(), resolver.is_chief, resolver.world_size) == ("", True, 1)
