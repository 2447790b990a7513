"""ClusterSpec: TF's job → tasks mapping, its forms, and every error it raises."""

from __future__ import annotations

import pytest

from phalanx.cluster import ClusterSpec

CLUSTER = {"chief": ["h:1"], "worker": ["h:2", "h:3"], "ps": ["h:4"]}


def test_dense_jobs_round_trip_as_lists():
    spec = ClusterSpec(CLUSTER)
    assert spec.jobs == ["chief", "ps", "worker"]
    assert spec.num_tasks("worker") == 2
    assert spec.task_indices("worker") == [0, 1]
    assert spec.task_address("worker", 1) == "h:3"
    assert spec.job_tasks("worker") == ["h:2", "h:3"]
    assert spec.as_dict() == CLUSTER


def test_sparse_jobs_keep_their_indices_and_gaps():
    spec = ClusterSpec({"worker": {2: "a:3", 0: "a:1"}})
    assert spec.task_indices("worker") == [0, 2]
    assert spec.job_tasks("worker") == ["a:1", None, "a:3"]
    assert spec.as_dict() == {"worker": {0: "a:1", 2: "a:3"}}


def test_json_string_indices_and_tuples_are_accepted():
    assert ClusterSpec({"worker": {"0": "a:1", "1": "a:2"}}).as_dict() == {"worker": ["a:1", "a:2"]}
    assert ClusterSpec({"worker": ("a:1",)}).as_dict() == {"worker": ["a:1"]}


def test_empty_job_and_empty_cluster():
    spec = ClusterSpec({"worker": []})
    assert spec.as_dict() == {"worker": {}}
    assert spec.job_tasks("worker") == []
    assert spec
    assert not ClusterSpec({})
    assert not ClusterSpec()
    assert not ClusterSpec(None)


def test_equality_copy_and_repr():
    spec = ClusterSpec(CLUSTER)
    assert ClusterSpec(spec) == spec
    assert ClusterSpec({"worker": ["h:2", "h:3"]}) != spec
    assert spec != CLUSTER
    assert repr(ClusterSpec({"worker": ["a:1"]})) == "ClusterSpec({'worker': ['a:1']})"


def test_unknown_job_names_the_known_jobs():
    with pytest.raises(
        ValueError, match=r"No such job in the cluster: 'evaluator'.*\['chief', 'ps', 'worker'\]"
    ):
        ClusterSpec(CLUSTER).num_tasks("evaluator")
    for method in ("task_indices", "job_tasks"):
        with pytest.raises(ValueError, match="No such job"):
            getattr(ClusterSpec(CLUSTER), method)("master")


def test_missing_index_names_the_jobs_indices():
    with pytest.raises(ValueError, match=r"Job 'worker' has no task with index 5.*\[0, 1\]"):
        ClusterSpec(CLUSTER).task_address("worker", 5)


@pytest.mark.parametrize(
    ("cluster", "message"),
    [
        ({"Worker-1": ["a:1"]}, "Job names must be identifiers.*'Worker-1'"),
        ({3: ["a:1"]}, "Job names must be identifiers.*Received: 3"),
        ({"worker": [1]}, r"cluster\['worker'\]\[0\] must be a non-empty 'host:port' string. Received: 1"),
        ({"worker": [""]}, "must be a non-empty 'host:port' string"),
        (
            {"worker": "a:1"},
            r"must be a list .* or a dict .* Received: 'a:1' \(str\). HINT: \{'worker': \['a:1'\]\}",
        ),
        ({"worker": {"x": "a:1"}}, "task indices must be non-negative integers. Received: 'x'"),
        ({"worker": {-1: "a:1"}}, "task indices must be non-negative integers. Received: -1"),
        ({"worker": {True: "a:1"}}, "task indices must be non-negative integers. Received: True"),
        ({"worker": {0: "a:1", "0": "a:2"}}, "gives task index 0 twice"),
        (["a:1"], r"ClusterSpec takes a dict of job name -> tasks. Received: \['a:1'\] \(list\)"),
    ],
)
def test_malformed_clusters_are_rejected(cluster, message):
    with pytest.raises(ValueError, match=message):
        ClusterSpec(cluster)
