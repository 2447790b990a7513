"""SimpleClusterResolver: explicit values, TF's master() rule, validation at creation."""

from __future__ import annotations

import pytest

from phalanx.cluster import ClusterSpec, SimpleClusterResolver


def test_explicit_values():
    resolver = SimpleClusterResolver(
        ClusterSpec({"worker": ["a:1", "a:2"]}),
        master="grpc://a:1",
        task_type="worker",
        task_id=1,
        environment="google",
        num_accelerators={"GPU": 2},
        rpc_layer="grpc",
    )
    assert resolver.cluster_spec() == ClusterSpec({"worker": ["a:1", "a:2"]})
    assert resolver.master() == "grpc://a:1"  # the given master, not this task's address (TF)
    assert resolver.master("worker", 0) == "grpc://a:1"
    assert resolver.environment == "google"
    assert resolver.num_accelerators() == {"GPU": 2}
    assert (resolver.rank, resolver.is_chief) == (1, False)
    assert "task=worker:1" in repr(resolver)


def test_cluster_may_be_a_dict():
    assert SimpleClusterResolver({"worker": ["a:1"]}).cluster_spec().num_tasks("worker") == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"task_type": "worker", "task_id": 5}, "^SimpleClusterResolver 'task' index 5 is out of range"),
        ({"task_type": "boss", "task_id": 0}, "^SimpleClusterResolver 'task' type 'boss' is unknown"),
    ],
)
def test_validated_at_creation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SimpleClusterResolver({"worker": ["a:1"]}, **kwargs)
    with pytest.raises(ValueError, match="^SimpleClusterResolver 'cluster' gives the address 'a:1' to both"):
        SimpleClusterResolver({"worker": ["a:1", "a:1"]})
