"""ClusterSpec, resolvers and the catalogue of bad TF_CONFIGs."""

from __future__ import annotations

import json

import pytest

from phalanx.cluster import (
    ClusterSpec,
    SimpleClusterResolver,
    SlurmClusterResolver,
    TFConfigClusterResolver,
    TorchrunClusterResolver,
    expand_hostlist,
    resolve_cluster,
)
from phalanx.cluster.validation import validate_for_strategy

CLUSTER = {"chief": ["h:1"], "worker": ["h:2", "h:3"], "ps": ["h:4"]}


def test_cluster_spec():
    spec = ClusterSpec(CLUSTER)
    assert spec.jobs == ["chief", "ps", "worker"]
    assert spec.num_tasks("worker") == 2
    assert spec.task_address("worker", 1) == "h:3"
    assert spec.as_dict() == CLUSTER
    sparse = ClusterSpec({"worker": {0: "a:1", 2: "a:3"}})
    assert sparse.job_tasks("worker") == ["a:1", None, "a:3"]
    assert sparse.as_dict() == {"worker": {0: "a:1", 2: "a:3"}}
    assert sparse.task_indices("worker") == [0, 2]
    assert ClusterSpec(spec) == spec
    assert not ClusterSpec({})
    with pytest.raises(ValueError, match="No such job"):
        spec.num_tasks("evaluator")
    with pytest.raises(ValueError, match="has no task 5"):
        spec.task_address("worker", 5)
    with pytest.raises(ValueError, match="lower-case identifiers"):
        ClusterSpec({"Worker": ["a:1"]})
    with pytest.raises(ValueError, match="must be a 'host:port' string"):
        ClusterSpec({"worker": [1]})
    with pytest.raises(ValueError, match="task index must be an integer"):
        ClusterSpec({"worker": {"x": "a:1"}})


def test_tf_config_resolver(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": CLUSTER, "task": {"type": "worker", "index": 1}}))
    r = TFConfigClusterResolver()
    assert (r.task_type, r.task_id) == ("worker", 1)
    assert r.num_workers == 3
    assert r.worker_index == 2
    assert not r.is_chief
    assert r.chief_address() == "h:1"
    assert r.master() == "h:3"
    assert r.master("ps", 0, rpc_layer="grpc") == "grpc://h:4"
    assert r.task_name(0) == "chief:0 (h:1)"
    assert isinstance(resolve_cluster(), TFConfigClusterResolver)
    monkeypatch.setenv(
        "TF_CONFIG",
        json.dumps({"cluster": {"worker": ["a:1", "a:2"]}, "task": {"type": "worker", "index": 0}}),
    )
    assert TFConfigClusterResolver().is_chief


@pytest.mark.parametrize(
    ("tf_config", "message"),
    [
        ("{not json", "not valid JSON: .* line 1 column 2"),
        ('["a"]', "must be a JSON object"),
        ('{"task": {"type": "worker", "index": 0}}', "no 'cluster' field"),
        ('{"cluster": {"worker": ["a:1", "a:2"]}}', "no 'task' field"),
        ('{"cluster": {"master": ["a:1"]}, "task": {"type": "master", "index": 0}}', "unknown job 'master'"),
        (
            '{"cluster": {"worker": ["a:1"]}, "task": {"type": "boss", "index": 0}}',
            "task type 'boss' is unknown",
        ),
        (
            '{"cluster": {"worker": ["a:1"]}, "task": {"type": "chief", "index": 0}}',
            "not a job of the cluster",
        ),
        (
            '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 3}}',
            "index 3 is out of range",
        ),
        ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": -1}}', "non-negative integer"),
        (
            '{"cluster": {"worker": ["a:1", "a:1"]}, "task": {"type": "worker", "index": 0}}',
            "used by both worker:0 and worker:1",
        ),
        ('{"cluster": {"chief": ["a:1", "a:2"]}, "task": {"type": "chief", "index": 0}}', "2 chiefs"),
        ('{"cluster": {"worker": []}, "task": {"type": "worker", "index": 0}}', "has no tasks"),
        ('{"cluster": ["a:1"], "task": {}}', "'cluster' must be an object"),
        ('{"cluster": {"worker": ["a:1"]}, "task": "worker"}', "'task' must be an object"),
    ],
)
def test_bad_tf_config_catalogue(monkeypatch, tf_config, message):
    monkeypatch.setenv("TF_CONFIG", tf_config)
    with pytest.raises(ValueError, match=message):
        TFConfigClusterResolver()


def test_ps_job_rejected_by_strategies_without_ps():
    with pytest.raises(ValueError, match="does not use parameter servers.*HINT"):
        validate_for_strategy(ClusterSpec(CLUSTER), "MultiWorkerMirroredStrategy", allow_ps=False)
    validate_for_strategy(ClusterSpec(CLUSTER), "ParameterServerStrategy", allow_ps=True)


def test_torchrun_resolver(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("LOCAL_RANK", "1")
    r = resolve_cluster()
    assert isinstance(r, TorchrunClusterResolver)
    assert (r.worker_index, r.num_workers, r.local_rank, r.chief_address()) == (1, 2, 1, "10.0.0.1:29500")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match="RANK must be in"):
        TorchrunClusterResolver()
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="must be integers"):
        TorchrunClusterResolver()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ValueError, match="WORLD_SIZE is not set"):
        TorchrunClusterResolver()


def test_slurm(monkeypatch):
    assert expand_hostlist("node[1-3,5],gpu-[01-02]") == [
        "node1",
        "node2",
        "node3",
        "node5",
        "gpu-01",
        "gpu-02",
    ]
    assert expand_hostlist("single") == ["single"]
    with pytest.raises(ValueError, match="unbalanced brackets"):
        expand_hostlist("node[1-2")
    with pytest.raises(ValueError, match="Bad SLURM host range"):
        expand_hostlist("node[a-b]")
    for key in ("TF_CONFIG", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-2]")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "2(x2)")
    r = resolve_cluster()
    assert isinstance(r, SlurmClusterResolver)
    assert r.cluster_spec().as_dict() == {"worker": ["n1:8888", "n1:8889", "n2:8888", "n2:8889"]}
    assert (r.task_type, r.task_id) == ("worker", 3)
    with pytest.raises(ValueError, match="jobs ask for 3"):
        SlurmClusterResolver(jobs={"worker": 3})
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "two")
    with pytest.raises(ValueError, match="tasks-per-node"):
        SlurmClusterResolver()
    monkeypatch.delenv("SLURM_PROCID")
    with pytest.raises(ValueError, match="SLURM_PROCID is not set"):
        SlurmClusterResolver()


def test_simple_resolver_and_single_task_default(monkeypatch):
    for key in ("TF_CONFIG", "RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)
    single = resolve_cluster()
    assert single.is_chief
    assert single.num_workers == 1
    r = SimpleClusterResolver(
        ClusterSpec({"worker": ["a:1"]}),
        master="grpc://a:1",
        task_type="worker",
        task_id=0,
        num_accelerators={"GPU": 2},
    )
    assert r.master() == "grpc://a:1"
    assert r.num_accelerators() == {"GPU": 2}
    assert "task=worker:0" in repr(r)
