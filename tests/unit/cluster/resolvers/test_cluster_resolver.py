"""The base resolver's derived properties: chief, ranks, rendezvous address, accelerators."""

from __future__ import annotations

import pytest
import torch

from phalanx.cluster import ClusterResolver, ClusterSpec, SimpleClusterResolver

WITH_CHIEF = {"chief": ["h:1"], "worker": ["h:2", "h:3"], "ps": ["h:4"]}
WORKERS = {"worker": ["w:0", "w:1", "w:2"]}


def _at(cluster, task_type, task_id):
    return SimpleClusterResolver(cluster, task_type=task_type, task_id=task_id)


def test_cluster_resolver_is_abstract():
    with pytest.raises(TypeError, match="abstract"):
        ClusterResolver()


@pytest.mark.parametrize(
    ("task", "rank", "chief"),
    [(("chief", 0), 0, True), (("worker", 0), 1, False), (("worker", 1), 2, False)],
)
def test_with_a_chief_workers_shift_by_one(task, rank, chief):
    resolver = _at(WITH_CHIEF, *task)
    assert (resolver.worker_index, resolver.rank, resolver.is_chief) == (rank, rank, chief)
    assert (resolver.num_workers, resolver.world_size) == (3, 3)
    assert resolver.chief_address() == "h:1"


@pytest.mark.parametrize("index", [0, 1, 2])
def test_without_a_chief_worker_0_is_chief(index):
    resolver = _at(WORKERS, "worker", index)
    assert resolver.rank == index
    assert resolver.is_chief == (index == 0)
    assert resolver.chief_address() == "w:0"
    assert resolver.task_name(2) == "worker:2 (w:2)"
    assert resolver.task_name(7) == "worker:7"


def test_ps_and_evaluator_tasks_have_no_rank():
    ps = _at(WITH_CHIEF, "ps", 0)
    assert not ps.is_chief
    assert ps.num_workers == 3
    with pytest.raises(ValueError, match="defined for chief and worker tasks only; this task is ps:0"):
        _ = ps.rank


def test_a_lone_process_is_the_chief_of_a_world_of_one():
    resolver = SimpleClusterResolver({})
    assert (resolver.is_chief, resolver.rank, resolver.world_size) == (True, 0, 1)
    assert resolver.master() == ""
    with pytest.raises(ValueError, match="no 'chief' or 'worker' task, so there is no rendezvous address"):
        resolver.chief_address()


def test_an_unknown_task_in_a_cluster_of_several_is_an_error():
    resolver = SimpleClusterResolver(WORKERS)
    with pytest.raises(ValueError, match="has 3 chief/worker tasks but does not say which one"):
        _ = resolver.is_chief
    assert SimpleClusterResolver({"worker": ["w:0"]}).is_chief


def test_task_type_and_id_are_settable_and_checked():
    resolver = _at(WORKERS, "worker", 0)
    resolver.task_id = 2
    assert (resolver.task_id, resolver.rank) == (2, 2)
    resolver.task_type = "ps"
    assert resolver.task_type == "ps"
    with pytest.raises(ValueError, match="task_type must be a job name"):
        resolver.task_type = 3
    with pytest.raises(ValueError, match="task_id must be a non-negative int or None. Received: -1"):
        resolver.task_id = -1


def test_master_formats_the_rpc_layer():
    resolver = SimpleClusterResolver(WITH_CHIEF, task_type="worker", task_id=1, rpc_layer="grpc")
    assert resolver.master("ps", 0) == "grpc://h:4"
    assert resolver.master("ps", 0, rpc_layer="http") == "http://h:4"
    with pytest.raises(ValueError, match="has no task with index 9"):
        resolver.master("worker", 9)


def test_base_master_uses_this_task():
    class Fixed(ClusterResolver):
        def cluster_spec(self):
            return ClusterSpec(WORKERS)

    resolver = Fixed()
    assert resolver.master() == ""
    resolver.task_type, resolver.task_id, resolver.rpc_layer = "worker", 1, "grpc"
    assert resolver.master() == "grpc://w:1"
    assert resolver.environment == ""
    assert "Fixed(task=worker:1" in repr(resolver)


def test_num_accelerators_counts_cuda_devices(monkeypatch):
    resolver = SimpleClusterResolver({})
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolver.num_accelerators() == {"GPU": 2}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert resolver.num_accelerators() == {}
