"""Cluster resolvers, ClusterSpec, Server and experimental.rpc members that TF 2.21 has."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import phalanx
from phalanx import rpc
from phalanx.cluster import ClusterSpec
from phalanx.cluster._ports import free_ports
from phalanx.cluster.cluster_def import ClusterDef, JobDef, ServerDef
from phalanx.cluster.resolvers import (
    KubernetesClusterResolver,
    KubernetesExecutableLocation,
    SimpleClusterResolver,
    SlurmClusterResolver,
    UnionResolver,
)
from phalanx.ps.rpc.errors import TaskUnavailableError
from phalanx.security.token import TOKEN_ENV

TOKEN = "test-secret-0123456789"


def test_cluster_def_has_tf_field_names_and_round_trips():
    spec = ClusterSpec({"worker": ["a:1", "b:2"], "ps": {3: "c:3"}})
    cluster_def = spec.as_cluster_def()
    assert cluster_def == ClusterDef((JobDef("worker", {0: "a:1", 1: "b:2"}), JobDef("ps", {3: "c:3"})))
    assert [job.name for job in cluster_def.job] == ["worker", "ps"]
    assert ClusterSpec(cluster_def) == spec  # TF: ClusterSpec(cluster_def)


def test_a_local_server_serves_and_describes_itself(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    server = phalanx.Server.create_local_server()
    try:
        definition = server.server_def
        assert isinstance(definition, ServerDef)
        assert (definition.job_name, definition.task_index, definition.protocol) == ("ps", 0, "grpc")
        assert server.target == f"grpc://127.0.0.1:{definition.port}"
        assert ClusterSpec(definition.cluster).as_dict() == {"ps": [f"127.0.0.1:{definition.port}"]}
        # a real ps task: a coordinator's client can reach it
        from phalanx.ps.transport import RpcClient

        client = RpcClient(f"127.0.0.1:{definition.port}", TOKEN, name="ps:0", timeout=30)
        try:
            client.wait_until_ready(30)
        finally:
            client.close()
    finally:
        server.stop()
    with pytest.raises(ValueError, match="takes no config"):
        phalanx.Server.create_local_server(config={"allow_soft_placement": True})


def test_union_resolver_joins_clusters_and_keeps_the_first_task():
    workers = SimpleClusterResolver(
        {"worker": ["w0:1", "w1:1"]}, task_type="worker", task_id=1, rpc_layer="grpc", environment="google"
    )
    ps = SimpleClusterResolver({"ps": ["p0:1"]})
    union = UnionResolver(workers, ps)
    assert union.cluster_spec().as_dict() == {"worker": ["w0:1", "w1:1"], "ps": ["p0:1"]}
    assert (union.task_type, union.task_id, union.rpc_layer, union.environment) == (
        "worker",
        1,
        "grpc",
        "google",
    )
    assert union.master() == ""  # the first resolver's master: none was given
    assert union.master("ps", 0) == "grpc://p0:1"
    assert union.num_accelerators() == workers.num_accelerators()
    other = UnionResolver(workers, ps, task_type="ps", task_id=0, rpc_layer="")
    assert (other.task_type, other.task_id, other.master("ps", 0)) == ("ps", 0, "p0:1")
    sparse = UnionResolver(
        SimpleClusterResolver({"worker": {0: "a:1"}}), SimpleClusterResolver({"worker": {1: "b:1"}})
    )
    assert sparse.cluster_spec().as_dict() == {"worker": ["a:1", "b:1"]}


def test_union_resolver_errors():
    with pytest.raises(ValueError, match="at least one cluster resolver"):
        UnionResolver()
    with pytest.raises(ValueError, match="joins cluster resolvers. Received: dict"):
        UnionResolver({"worker": ["a:1"]})
    listed = SimpleClusterResolver({"worker": ["a:1"]})
    with pytest.raises(KeyError, match="given as a list of tasks by more than one resolver"):
        UnionResolver(listed, listed).cluster_spec()
    clash = UnionResolver(
        SimpleClusterResolver({"worker": {1: "a:1"}}), SimpleClusterResolver({"worker": {1: "b:1"}})
    )
    with pytest.raises(KeyError, match="Task worker:1 has two addresses"):
        clash.cluster_spec()


def _pod(name, ip, phase="Running"):
    return SimpleNamespace(
        metadata=SimpleNamespace(name=name), status=SimpleNamespace(pod_ip=ip, phase=phase)
    )


class _CoreV1Api:
    """The part of kubernetes.client.CoreV1Api the resolver calls, over a fixed set of pods."""

    def __init__(self, pods):
        self.pods = pods  # label selector -> pods
        self.selectors = []

    def list_pod_for_all_namespaces(self, label_selector):
        self.selectors.append(label_selector)
        return SimpleNamespace(items=self.pods.get(label_selector, []))


def test_kubernetes_resolver_lists_running_pods_by_job(monkeypatch):
    client = _CoreV1Api(
        {
            "job-name=worker": [_pod("w-1", "10.0.0.2"), _pod("w-0", "10.0.0.1")],
            "job-name=ps": [_pod("ps-0", "10.0.1.1")],
        }
    )
    monkeypatch.setattr("socket.gethostname", lambda: "w-1")
    resolver = KubernetesClusterResolver(
        {"worker": ["job-name=worker"], "ps": ["job-name=ps"]}, tf_server_port=2222, override_client=client
    )
    assert resolver.cluster_spec().as_dict() == {
        "worker": ["10.0.0.1:2222", "10.0.0.2:2222"],
        "ps": ["10.0.1.1:2222"],
    }
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)
    assert resolver.master() == "grpc://10.0.0.2:2222"
    outside = KubernetesClusterResolver(
        {"worker": ["job-name=worker"]},
        override_client=client,
        executable_location=KubernetesExecutableLocation.OFF_CLUSTER,
    )
    assert (outside.task_type, outside.task_id) == (None, None)


def test_kubernetes_resolver_errors(monkeypatch):
    pending = _CoreV1Api({"job-name=tensorflow": [_pod("w-0", None, phase="Pending")]})
    resolver = KubernetesClusterResolver(override_client=pending)
    assert pending.selectors == ["job-name=tensorflow"]  # TF's default mapping
    with pytest.raises(RuntimeError, match="Pod 'w-0' of job 'worker' is Pending, not Running"):
        resolver.cluster_spec()
    monkeypatch.setitem(__import__("sys").modules, "kubernetes", None)  # not installed
    with pytest.raises(ImportError, match="pip install kubernetes"):
        KubernetesClusterResolver()


def test_slurm_task_info(monkeypatch):
    for name, value in {
        "SLURM_PROCID": "1",
        "SLURM_STEP_NODELIST": "node[1-2]",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    }.items():
        monkeypatch.setenv(name, value)
    for name in ("SLURM_LOCALID", "SLURMD_NODENAME"):
        monkeypatch.delenv(name, raising=False)
    resolver = SlurmClusterResolver(gpus_per_node=0)
    assert resolver.get_task_info() == ("worker", 1)


def test_rpc_calls_registered_functions_over_authenticated_grpc(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    address = f"127.0.0.1:{free_ports(1)[0]}"
    server = phalanx.experimental.rpc.Server.create("grpc", address)
    server.register("multiply", lambda a, b: a * b)
    server.register("split", lambda a: {"half": a / 2, "parts": (a[:1], a[1:])})
    server.register("fail", lambda: 1 / 0)
    server.start()
    client = phalanx.experimental.rpc.Client.create("grpc", address, timeout_in_ms=30_000)
    try:
        result = client.call("multiply", [torch.tensor(2.0), torch.tensor(3.0)])
        assert result.is_ok()
        assert result.get_error() == (0, "")
        assert float(result.get_value()) == 6.0
        assert float(client.multiply(torch.tensor(4.0), torch.tensor(0.5))) == 2.0
        parts = client.split(torch.tensor([2.0, 4.0]))
        assert parts["half"].tolist() == [1.0, 2.0]
        assert [p.tolist() for p in parts["parts"]] == [[2.0], [4.0]]
        failed = client.call("fail")
        assert not failed.is_ok()
        assert failed.get_error()[0] == rpc.INTERNAL
        assert "ZeroDivisionError" in failed.get_error()[1]
        with pytest.raises(RuntimeError, match="The rpc failed \\(code 13\\)"):
            failed.get_value()
        assert client.call("nothing").get_error()[0] == rpc.NOT_FOUND
        with pytest.raises(TypeError, match="must be tensors"):
            client.call("multiply", [2.0, 3.0])
        with pytest.raises(RuntimeError, match="before Server.start"):
            server.register("late", lambda: None)
    finally:
        client.close()
        server.stop()


def test_rpc_errors_before_any_call(monkeypatch):
    with pytest.raises(ValueError, match="The only rpc_layer is 'grpc'"):
        rpc.Server.create("http", "127.0.0.1:1")
    with pytest.raises(ValueError, match="must be host:port"):
        rpc.Server.create("grpc", "localhost")
    with pytest.raises(TypeError, match="needs a callable"):
        rpc.Server.create("grpc", "127.0.0.1:1").register("x", 3)
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(ValueError, match=TOKEN_ENV):
        rpc.Client.create("grpc", "127.0.0.1:1")


def test_rpc_client_names_the_server_that_does_not_answer(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    address = f"127.0.0.1:{free_ports(1)[0]}"  # nothing serves it
    with pytest.raises(TaskUnavailableError, match=rf"rpc server \({address}\) did not answer"):
        rpc.Client.create("grpc", address, timeout_in_ms=500)
