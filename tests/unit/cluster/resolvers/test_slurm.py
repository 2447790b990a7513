"""SlurmClusterResolver and SLURM's list formats, without SLURM: only its variables are set."""

from __future__ import annotations

import os

import pytest
import torch

from phalanx.cluster import SlurmClusterResolver, expand_hostlist
from phalanx.cluster.resolvers import expand_tasks_per_node


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("node[1-3,5],gpu-[01-02]", ["node1", "node2", "node3", "node5", "gpu-01", "gpu-02"]),
        ("single", ["single"]),
        ("a,b", ["a", "b"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[008-010]", ["n008", "n009", "n010"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("n[1]-ib", ["n1-ib"]),
        ("", []),
    ],
)
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize(
    ("hostlist", "message"),
    [
        ("node[1-2", "a '\\[' is never closed"),
        ("node1-2]", "unbalanced or nested brackets"),
        ("n[[1]]", "unbalanced or nested brackets"),
        ("node[a-b]", "Bad SLURM host range 'a-b'"),
        ("node[3-1]", "Bad SLURM host range '3-1'.*LOW <= HIGH"),
        ("a,,b", "empty host name"),
    ],
)
def test_bad_hostlists(hostlist, message):
    with pytest.raises(ValueError, match=message):
        expand_hostlist(hostlist)


def test_expand_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(ValueError, match="item 'two' is neither N nor N\\(xM\\)"):
        expand_tasks_per_node("two")


@pytest.fixture
def slurm(clean_cluster_env):
    """Two nodes, two tasks each, this process is task 3 (the second on n2); no GPUs."""
    env = clean_cluster_env
    env.setenv("SLURM_PROCID", "3")
    env.setenv("SLURM_STEP_NODELIST", "n[1-2]")
    env.setenv("SLURM_STEP_TASKS_PER_NODE", "2(x2)")
    env.setattr(torch.cuda, "device_count", lambda: 0)
    return env


def test_block_layout_ports_by_local_index(slurm):
    resolver = SlurmClusterResolver()
    assert resolver.cluster_spec().as_dict() == {"worker": ["n1:8888", "n1:8889", "n2:8888", "n2:8889"]}
    assert (resolver.task_type, resolver.task_id, resolver.rank) == ("worker", 3, 3)
    assert resolver.master() == "grpc://n2:8889"
    assert resolver.num_accelerators() == {}
    assert resolver.environment == ""


def test_jobs_are_split_in_sorted_order_so_the_chief_is_rank_0(slurm):
    resolver = SlurmClusterResolver(jobs={"worker": 2, "ps": 1, "chief": 1}, port_base=9000)
    assert resolver.cluster_spec().as_dict() == {
        "chief": ["n1:9000"],
        "ps": ["n1:9001"],
        "worker": ["n2:9000", "n2:9001"],
    }
    assert (resolver.task_type, resolver.task_id, resolver.rank) == ("worker", 1, 2)


def test_fallback_variables_and_explicit_tasks_per_node(slurm):
    slurm.delenv("SLURM_STEP_NODELIST")
    slurm.delenv("SLURM_STEP_TASKS_PER_NODE")
    slurm.setenv("SLURM_JOB_NODELIST", "n[1-2]")
    slurm.setenv("SLURM_NTASKS_PER_NODE", "2")
    assert SlurmClusterResolver().cluster_spec().num_tasks("worker") == 4
    resolver = SlurmClusterResolver(tasks_per_node={"n1": 1, "n2": 3})
    assert resolver.cluster_spec().task_address("worker", 3) == "n2:8890"
    assert SlurmClusterResolver(tasks_per_node=3).cluster_spec().num_tasks("worker") == 6


def test_gpus_are_split_between_a_nodes_tasks(slurm):
    resolver = SlurmClusterResolver(gpus_per_node=4, auto_set_gpu=True)
    assert resolver.gpu_ids == [2, 3]
    assert resolver.num_accelerators() == {"GPU": 2}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert SlurmClusterResolver(gpus_per_node=4, gpus_per_task=1).gpu_ids == [1]


def test_placement_is_checked_against_slurms_own(slurm):
    slurm.setenv("SLURM_LOCALID", "1")
    slurm.setenv("SLURMD_NODENAME", "n2")
    SlurmClusterResolver()
    slurm.setenv("SLURMD_NODENAME", "n1")
    with pytest.raises(
        ValueError, match="assumes SLURM's block distribution. HINT: srun --distribution=block"
    ):
        SlurmClusterResolver()


@pytest.mark.parametrize(
    ("changes", "kwargs", "message"),
    [
        ({"SLURM_PROCID": None}, {}, "none of SLURM_PROCID is set"),
        (
            {"SLURM_PROCID": "x"},
            {},
            "SLURM_PROCID must be a non-negative integer. Received: SLURM_PROCID='x'",
        ),
        ({"SLURM_STEP_NODELIST": None}, {}, "none of SLURM_STEP_NODELIST, SLURM_JOB_NODELIST is set"),
        ({"SLURM_STEP_TASKS_PER_NODE": None}, {}, "none of SLURM_STEP_TASKS_PER_NODE, SLURM_TASKS_PER_NODE"),
        ({"SLURM_STEP_TASKS_PER_NODE": "2,2,2"}, {}, r"tasks per node \[2, 2, 2\] do not match its 2 node"),
        ({}, {"tasks_per_node": {"n1": 2}}, r"tasks_per_node has no count for node\(s\) \['n2'\]"),
        ({}, {"jobs": {"worker": 5}}, "jobs ask for 5 tasks but SLURM runs 4"),
        ({}, {"jobs": {"worker": 3}}, "SLURM_PROCID=3 is past the 3 tasks"),
        ({}, {"gpus_per_node": 2, "gpus_per_task": 2}, "each need 4 GPUs, but a node has 2"),
        ({}, {"jobs": {"master": 4}}, "^SLURM 'cluster' has an unknown job 'master'"),
        ({}, {"port_base": 65535}, "port in 0..65535"),
    ],
)
def test_bad_slurm_settings_are_named(slurm, changes, kwargs, message):
    for name, value in changes.items():
        if value is None:
            slurm.delenv(name)
        else:
            slurm.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        SlurmClusterResolver(**kwargs)
