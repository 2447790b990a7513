"""KubernetesClusterResolver: the cluster from the pods Kubernetes runs (``tf.distribute.cluster_resolver``).

Needs the optional ``kubernetes`` client (``pip install kubernetes``) unless a client is
given; it is imported when the resolver is created, never at import.
"""

from __future__ import annotations

import enum
import socket
from collections.abc import Mapping, Sequence
from typing import Any

from phalanx.cluster.cluster_spec import ClusterSpec
from phalanx.cluster.resolvers.cluster_resolver import ClusterResolver

__all__ = ["KubernetesClusterResolver", "KubernetesExecutableLocation"]


class KubernetesExecutableLocation(enum.Enum):
    """Where the program runs: in a pod of the cluster, or outside it (kubeconfig)."""

    OFF_CLUSTER = "OFF_CLUSTER"
    WITHIN_CLUSTER = "WITHIN_CLUSTER"


class KubernetesClusterResolver(ClusterResolver):
    """Each job's tasks are the running pods matching its label selectors, sorted by name.

    A task's address is ``pod_ip:tf_server_port``. Within the cluster, this process's task is
    the pod whose name is this host's name (Kubernetes sets the hostname to the pod name).

    Args:
        job_to_label_mapping: ``{job: [label selector, ...]}``; default
            ``{"worker": ["job-name=tensorflow"]}`` (TF's).
        tf_server_port: The port every task listens on.
        rpc_layer: Protocol prefix for ``master()``.
        override_client: A Kubernetes ``CoreV1Api`` (or anything with its
            ``list_pod_for_all_namespaces(label_selector=...)``); default one is made from
            the in-cluster configuration (WITHIN_CLUSTER) or the kubeconfig (OFF_CLUSTER).
        executable_location: A `KubernetesExecutableLocation`.

    Raises:
        ImportError: No ``override_client`` and the ``kubernetes`` package is not installed.
    """

    source = "Kubernetes"

    def __init__(
        self,
        job_to_label_mapping: Mapping[str, Sequence[str]] | None = None,
        tf_server_port: int = 8470,
        rpc_layer: str | None = "grpc",
        override_client: Any = None,
        executable_location: KubernetesExecutableLocation = KubernetesExecutableLocation.WITHIN_CLUSTER,
    ) -> None:
        self._jobs = dict(job_to_label_mapping or {"worker": ["job-name=tensorflow"]})
        self._port = tf_server_port
        self.rpc_layer = rpc_layer
        self._location = KubernetesExecutableLocation(executable_location)
        self._client = override_client if override_client is not None else _default_client(self._location)
        if self._location is KubernetesExecutableLocation.WITHIN_CLUSTER:
            self.task_type, self.task_id = self._own_task()

    def _pods(self, job: str) -> list[Any]:
        pods: dict[str, Any] = {}
        for selector in self._jobs[job]:
            for pod in self._client.list_pod_for_all_namespaces(label_selector=selector).items:
                pods[pod.metadata.name] = pod
        return [pods[name] for name in sorted(pods)]

    def cluster_spec(self) -> ClusterSpec:
        """Every job's pods, asked of Kubernetes now.

        Raises:
            RuntimeError: A pod is not running yet (its address may still change).
        """
        cluster: dict[str, list[str]] = {}
        for job in self._jobs:
            addresses = []
            for pod in self._pods(job):
                if pod.status.phase != "Running":
                    raise RuntimeError(
                        f"Pod {pod.metadata.name!r} of job {job!r} is {pod.status.phase}, not Running. "
                        "HINT: create the resolver once every pod of the job runs."
                    )
                addresses.append(f"{pod.status.pod_ip}:{self._port}")
            cluster[job] = addresses
        return ClusterSpec(cluster)

    def _own_task(self) -> tuple[str | None, int | None]:
        host = socket.gethostname()
        for job in self._jobs:
            names = [pod.metadata.name for pod in self._pods(job)]
            if host in names:
                return job, names.index(host)
        return None, None


def _default_client(location: KubernetesExecutableLocation) -> Any:
    try:
        from kubernetes import client, config  # type: ignore[import-not-found]
    except ImportError as error:
        raise ImportError(
            "KubernetesClusterResolver needs the kubernetes client. HINT: pip install kubernetes, "
            "or pass override_client=<a kubernetes.client.CoreV1Api>."
        ) from error
    if location is KubernetesExecutableLocation.WITHIN_CLUSTER:
        config.load_incluster_config()
    else:
        config.load_kube_config()
    return client.CoreV1Api()
