"""UnionResolver: one cluster made of several resolvers' clusters (``tf.distribute.cluster_resolver``)."""

from __future__ import annotations

from typing import Any

from phalanx.cluster.cluster_spec import ClusterSpec
from phalanx.cluster.resolvers.cluster_resolver import ClusterResolver, format_master_url

__all__ = ["UnionResolver"]


class UnionResolver(ClusterResolver):
    """The union of other resolvers' clusters, e.g. workers from SLURM plus a fixed ps job.

    The task, ``rpc_layer``, ``environment``, ``master()`` and ``num_accelerators()`` are the
    first resolver's unless given here (as in TF).

    Args:
        *resolvers: The resolvers to join (at least one).
        task_type: This process's job (default: the first resolver's).
        task_id: This process's index (default: the first resolver's).
        rpc_layer: Protocol prefix for ``master()`` (default: the first resolver's).

    Raises:
        ValueError: No resolvers, or something that is not a `ClusterResolver`.
    """

    source = "UnionResolver"

    def __init__(
        self,
        *resolvers: ClusterResolver,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
    ) -> None:
        if not resolvers:
            raise ValueError("UnionResolver needs at least one cluster resolver. Received none.")
        for resolver in resolvers:
            if not isinstance(resolver, ClusterResolver):
                raise ValueError(
                    f"UnionResolver joins cluster resolvers. Received: {type(resolver).__name__}. "
                    "HINT: wrap a plain cluster in SimpleClusterResolver(cluster_spec)."
                )
        self._resolvers = resolvers
        first = resolvers[0]
        self.task_type = task_type if task_type is not None else first.task_type
        self.task_id = task_id if task_id is not None else first.task_id
        self.rpc_layer = rpc_layer if rpc_layer is not None else first.rpc_layer

    def cluster_spec(self) -> ClusterSpec:
        """Every resolver's jobs; a job in several resolvers gets all their tasks.

        Raises:
            KeyError: Two resolvers give one task different addresses, or a job listed as
                a list by several resolvers (its indices would clash; as in TF).
        """
        merged: dict[str, dict[int, str]] = {}
        for resolver in self._resolvers:
            for job, tasks in resolver.cluster_spec().as_dict().items():
                if isinstance(tasks, list) and job in merged:
                    raise KeyError(
                        f"Job {job!r} is given as a list of tasks by more than one resolver, so its "
                        "task indices clash. HINT: give it as a dict {task_index: address} in each."
                    )
                _merge_job(
                    merged.setdefault(job, {}),
                    job,
                    dict(enumerate(tasks)) if isinstance(tasks, list) else tasks,
                )
        return ClusterSpec(merged)

    @property
    def environment(self) -> str:
        """The first resolver's environment."""
        return self._resolvers[0].environment

    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        """The address of the given task in the union, else the first resolver's master."""
        if task_type is not None and task_id is not None:
            address = self.cluster_spec().task_address(task_type, task_id)
            return format_master_url(address, rpc_layer or self.rpc_layer)
        return self._resolvers[0].master(rpc_layer=rpc_layer or self.rpc_layer)

    def num_accelerators(
        self, task_type: str | None = None, task_id: int | None = None, config_proto: Any = None
    ) -> dict[str, int]:
        """The first resolver's answer."""
        return self._resolvers[0].num_accelerators(task_type, task_id, config_proto)


def _merge_job(into: dict[int, str], job: str, tasks: dict[int, str]) -> None:
    for index, address in tasks.items():
        if into.get(index, address) != address:
            raise KeyError(
                f"Task {job}:{index} has two addresses in the joined resolvers: {into[index]!r} "
                f"and {address!r}. HINT: give each task in one resolver only."
            )
        into[index] = address
