"""What each launched task gets: TF_CONFIG, torchrun's variables, unique free ports."""

from __future__ import annotations

import json
import socket

import pytest

from phalanx.cluster import ClusterSpec, TFConfigClusterResolver
from phalanx.cluster._ports import free_ports
from phalanx.cluster._tasks import cluster_from, local_cluster, plan_tasks, select_node_tasks
from phalanx.cluster.launcher import node_environments, task_environments

REMOTE = {"chief": ["n1:2000"], "worker": ["n1:2001", "n2:2000", "n2:2001"], "ps": ["n2:2002"]}


def test_local_environments_agree_with_the_resolvers():
    envs = task_environments(2, ps=1, chief=True)
    assert sorted(envs) == ["chief-0", "ps-0", "worker-0", "worker-1"]
    for name, env in envs.items():
        resolver = TFConfigClusterResolver(tf_config=env["TF_CONFIG"])
        assert f"{resolver.task_type}-{resolver.task_id}" == name
        if name == "ps-0":
            assert "RANK" not in env
            continue
        assert (int(env["RANK"]), int(env["WORLD_SIZE"])) == (resolver.rank, resolver.world_size)
        assert env["LOCAL_RANK"] == env["RANK"]
        assert env["LOCAL_WORLD_SIZE"] == "3"
        assert f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}" == resolver.chief_address()


def test_local_cluster_ports_are_distinct():
    spec = local_cluster(3, ps=2, chief=True)
    addresses = [spec.task_address(j, i) for j in spec.jobs for i in spec.task_indices(j)]
    assert len(set(addresses)) == 6
    assert all(a.startswith("127.0.0.1:") for a in addresses)


@pytest.mark.parametrize(("workers", "ps", "chief"), [(0, 0, False), (-1, 0, True), (1, -1, False)])
def test_a_cluster_needs_a_trainer_and_no_negative_counts(workers, ps, chief):
    with pytest.raises(ValueError, match="at least one chief or worker task and no negative counts"):
        task_environments(workers, ps, chief)


def test_free_ports_never_repeat_within_a_process():
    first, second = free_ports(20), free_ports(20)
    assert len(set(first) | set(second)) == 40
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", first[0]))  # released: a task can bind it
    with pytest.raises(ValueError, match="count >= 0"):
        free_ports(-1)


def test_per_node_ranks_are_global_and_local_ranks_per_node():
    envs = node_environments(REMOTE, "n2")
    assert sorted(envs) == ["ps-0", "worker-1", "worker-2"]
    assert [envs[n]["RANK"] for n in ("worker-1", "worker-2")] == ["2", "3"]
    assert [envs[n]["LOCAL_RANK"] for n in ("worker-1", "worker-2")] == ["0", "1"]
    assert envs["worker-1"]["LOCAL_WORLD_SIZE"] == "2"
    assert (envs["worker-1"]["MASTER_ADDR"], envs["worker-1"]["MASTER_PORT"]) == ("n1", "2000")
    assert json.loads(envs["ps-0"]["TF_CONFIG"])["cluster"] == REMOTE


def test_node_tasks_by_name_list_or_this_host(monkeypatch):
    spec = ClusterSpec(REMOTE)
    assert select_node_tasks(spec, [("worker", 2), ("ps", 0)]) == [("worker", 2), ("ps", 0)]
    monkeypatch.setattr(socket, "gethostname", lambda: "n1.cluster.local")
    assert select_node_tasks(spec) == [("chief", 0), ("worker", 0)]
    with pytest.raises(
        ValueError, match=r"No task of the cluster runs on node 'n3': the cluster's hosts are \['n1', 'n2'\]"
    ):
        select_node_tasks(spec, "n3")
    with pytest.raises(ValueError, match="has no task with index 7"):
        select_node_tasks(spec, [("worker", 7)])
    with pytest.raises(ValueError, match="names a task twice"):
        select_node_tasks(spec, [("ps", 0), ("ps", 0)])


def test_cluster_from_json_tf_config_or_cluster():
    assert cluster_from(json.dumps({"cluster": REMOTE, "task": {"type": "ps", "index": 0}})) == ClusterSpec(
        REMOTE
    )
    assert cluster_from(json.dumps(REMOTE)) == ClusterSpec(REMOTE)
    assert cluster_from(ClusterSpec(REMOTE)) == ClusterSpec(REMOTE)
    with pytest.raises(ValueError, match="^--tf-config is not valid JSON: .* line 1 column 2"):
        cluster_from("{oops")
    with pytest.raises(ValueError, match="^--tf-config 'cluster' has an unknown job 'master'"):
        cluster_from({"master": ["a:1"]})


def test_plan_gives_sparse_clusters_through_json():
    spec = ClusterSpec({"worker": {0: "a:1", 2: "a:3"}})
    (task,) = plan_tasks(spec, [("worker", 2)])
    assert TFConfigClusterResolver(tf_config=task.env["TF_CONFIG"]).cluster_spec() == spec
    assert (task.name, task.is_trainer, task.env["RANK"]) == ("worker-2", True, "1")


def test_free_ports_gives_up_when_every_port_was_handed_out(monkeypatch):
    from phalanx.cluster import _ports

    class Everything(list):
        def __contains__(self, port):
            return True

    monkeypatch.setattr(_ports, "_handed_out", Everything())
    with pytest.raises(OSError, match="found only 0 of 1 unused free ports"):
        free_ports(1)


def test_in_a_parameter_server_cluster_only_the_chief_is_a_trainer():
    spec = ClusterSpec({"chief": ["a:1"], "worker": ["a:2"], "ps": ["a:3"]})
    tasks = plan_tasks(spec, [("chief", 0), ("worker", 0), ("ps", 0)])
    assert [(t.name, t.is_trainer, t.coordinated) for t in tasks] == [
        ("chief-0", True, True),
        ("worker-0", False, True),
        ("ps-0", False, True),
    ]
    (worker,) = plan_tasks(ClusterSpec({"worker": ["a:1"], "ps": ["a:2"]}), [("worker", 0)])
    assert worker.is_trainer  # no chief: not a coordinated cluster
