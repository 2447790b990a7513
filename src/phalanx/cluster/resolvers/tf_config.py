"""TFConfigClusterResolver: the cluster from the ``TF_CONFIG`` environment variable."""

from __future__ import annotations

import os

from phalanx.cluster.cluster_spec import ClusterSpec
from phalanx.cluster.resolvers.cluster_resolver import ClusterResolver
from phalanx.cluster.validation import parse_tf_config, validate

__all__ = ["TFConfigClusterResolver"]


class TFConfigClusterResolver(ClusterResolver):
    """Reads ``TF_CONFIG`` (as Kubernetes/Kubeflow TFJob and ``phalanx launch`` set it).

    ``TF_CONFIG`` is JSON: ``{"cluster": {job: [host:port, ...]}, "task": {"type": job,
    "index": i}, "rpc_layer": ..., "environment": ...}`` with jobs among chief, worker, ps and
    evaluator. It is read once, when the resolver is created (TF re-reads it on every call);
    arguments given here override its fields. Unset or blank, it means a single process.

    Args:
        task_type: Overrides ``task.type``.
        task_id: Overrides ``task.index``.
        rpc_layer: Overrides ``rpc_layer``.
        environment: Overrides ``environment``.
        tf_config: JSON to read instead of the environment variable (phalanx addition).

    Raises:
        ValueError: Malformed JSON (with the position), no ``cluster``, no ``task`` for a
            cluster of several tasks, an unknown job or task type, an index out of range or
            negative, duplicate addresses, more than one chief or evaluator, an empty job.
            Each message names the field, what was received and the fix.
    """

    source = "TF_CONFIG"

    def __init__(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
        environment: str | None = None,
        *,
        tf_config: str | None = None,
    ) -> None:
        text = tf_config if tf_config is not None else os.environ.get("TF_CONFIG", "")
        config = parse_tf_config(text, self.source)
        task_type = task_type if task_type is not None else config.task_type
        task_id = task_id if task_id is not None else config.task_id
        validate(config.cluster, task_type, task_id, self.source)
        self._spec = config.cluster
        self.task_type, self.task_id = task_type, task_id
        self.rpc_layer = rpc_layer if rpc_layer is not None else config.rpc_layer
        self._environment = environment if environment is not None else config.environment

    def cluster_spec(self) -> ClusterSpec:
        """The cluster of ``TF_CONFIG`` (empty when it is unset)."""
        return self._spec

    @property
    def environment(self) -> str:
        """``TF_CONFIG``'s ``environment`` field ("" if absent)."""
        return self._environment
