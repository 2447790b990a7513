"""SimpleClusterResolver: a resolver from explicit values (``tf.distribute.cluster_resolver``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from phalanx.cluster.cluster_spec import ClusterSpec
from phalanx.cluster.resolvers.cluster_resolver import ClusterResolver, format_master_url
from phalanx.cluster.validation import validate

__all__ = ["SimpleClusterResolver"]


class SimpleClusterResolver(ClusterResolver):
    """A resolver holding a cluster spec and task given in code.

    Unlike TF, ``num_accelerators=None`` counts this machine's CUDA devices instead of
    reporting none. A cluster of several tasks may be given without ``task_type``/``task_id``
    (as TF allows); ``is_chief`` and ``rank`` then raise, since this process's task is unknown.

    Args:
        cluster_spec: The cluster (a ClusterSpec or a dict for one).
        master: What ``master()`` returns when called without a task.
        task_type: This process's job.
        task_id: This process's index in its job.
        environment: What the ``environment`` property returns.
        num_accelerators: ``{"GPU": n}`` to report; None counts local CUDA devices.
        rpc_layer: Protocol prefix for ``master()`` (e.g. "grpc").

    Raises:
        ValueError: The cluster or task breaks a rule of `phalanx.cluster.validation.validate`.
    """

    source = "SimpleClusterResolver"

    def __init__(
        self,
        cluster_spec: ClusterSpec | Mapping[str, Any],
        master: str = "",
        task_type: str | None = None,
        task_id: int | None = None,
        environment: str = "",
        num_accelerators: dict[str, int] | None = None,
        rpc_layer: str | None = None,
    ) -> None:
        self._spec = ClusterSpec(cluster_spec)
        validate(self._spec, task_type, task_id, self.source, require_task=False)
        self._master = master
        self.task_type, self.task_id = task_type, task_id
        self._environment = environment
        self._accelerators = None if num_accelerators is None else dict(num_accelerators)
        self.rpc_layer = rpc_layer

    def cluster_spec(self) -> ClusterSpec:
        """The cluster given at creation."""
        return self._spec

    @property
    def environment(self) -> str:
        """The ``environment`` given at creation."""
        return self._environment

    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        """The address of the given task, else the ``master`` given at creation (as TF).

        Raises:
            ValueError: The given task is not in the cluster.
        """
        if task_type is not None and task_id is not None:
            address = self._spec.task_address(task_type, task_id)
        else:
            address = self._master
        return format_master_url(address, rpc_layer or self.rpc_layer)

    def num_accelerators(
        self, task_type: str | None = None, task_id: int | None = None, config_proto: Any = None
    ) -> dict[str, int]:
        """The ``num_accelerators`` given at creation, else this machine's CUDA devices."""
        if self._accelerators is not None:
            return dict(self._accelerators)
        return super().num_accelerators(task_type, task_id, config_proto)
