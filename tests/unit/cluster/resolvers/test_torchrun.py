"""TorchrunClusterResolver: RANK/WORLD_SIZE/... read at creation; each bad variable is named."""

from __future__ import annotations

import pytest

from phalanx.cluster import TorchrunClusterResolver

ENV = {"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}


@pytest.fixture
def torchrun_env(clean_cluster_env):
    for name, value in {**ENV, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}.items():
        clean_cluster_env.setenv(name, value)
    return clean_cluster_env


def test_reads_torchruns_variables(torchrun_env):
    resolver = TorchrunClusterResolver()
    assert (resolver.task_type, resolver.task_id, resolver.rank, resolver.world_size) == ("worker", 1, 1, 3)
    assert (resolver.local_rank, resolver.local_world_size) == (1, 2)
    assert resolver.chief_address() == "10.0.0.1:29500"
    assert not resolver.is_chief
    assert resolver.cluster_spec().job_tasks("worker") == [
        "10.0.0.1:29500",
        "rank-1.torchrun.invalid:29500",
        "rank-2.torchrun.invalid:29500",
    ]


def test_a_world_of_one_needs_no_master(clean_cluster_env):
    clean_cluster_env.setenv("RANK", "0")
    clean_cluster_env.setenv("WORLD_SIZE", "1")
    resolver = TorchrunClusterResolver()
    assert (resolver.chief_address(), resolver.local_rank, resolver.local_world_size) == (
        "127.0.0.1:29500",
        0,
        1,
    )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"WORLD_SIZE": None}, "torchrun's environment is incomplete: WORLD_SIZE is not set. HINT"),
        ({"RANK": None}, "RANK is not set"),
        ({"MASTER_ADDR": None}, "MASTER_ADDR is not set"),
        ({"MASTER_PORT": None}, "MASTER_PORT is not set"),
        ({"RANK": "x"}, "RANK must be an integer. Received: RANK='x'"),
        ({"RANK": "3"}, r"RANK must be in \[0, WORLD_SIZE=3\). Received: RANK=3"),
        ({"WORLD_SIZE": "0"}, r"WORLD_SIZE must be in >= 1. Received: WORLD_SIZE=0"),
        ({"LOCAL_RANK": "2"}, r"LOCAL_RANK must be in \[0, LOCAL_WORLD_SIZE=2\)"),
        ({"MASTER_PORT": "99999"}, r"MASTER_PORT must be in \[0, 65536\)"),
    ],
)
def test_bad_variables_are_named(torchrun_env, changes, message):
    for name, value in changes.items():
        if value is None:
            torchrun_env.delenv(name)
        else:
            torchrun_env.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        TorchrunClusterResolver()


@pytest.mark.parametrize(("master", "address"), [("::1", "[::1]:29500"), ("[fe80::1]", "[fe80::1]:29500")])
def test_an_ipv6_master_addr_is_bracketed(torchrun_env, master, address):
    torchrun_env.setenv("MASTER_ADDR", master)
    assert TorchrunClusterResolver().chief_address() == address


def test_a_master_addr_that_is_no_host_is_refused(torchrun_env):
    torchrun_env.setenv("MASTER_ADDR", "my host")
    with pytest.raises(ValueError, match=r"worker:0: the host 'my host' is neither a DNS name"):
        TorchrunClusterResolver()
