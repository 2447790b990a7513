"""TF's ClusterDef and ServerDef messages, as plain dataclasses with the protos' field names.

``ClusterSpec.as_cluster_def()`` and ``Server.server_def`` return them. phalanx does not
depend on TensorFlow's protobufs; the field names (``job``, ``name``, ``tasks``,
``job_name``, ``task_index``, ``protocol``, ``port``) are TF's, so code that reads them
keeps working, and `ClusterDef.as_cluster_spec` turns one back into a `ClusterSpec`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from phalanx.cluster.cluster_spec import ClusterSpec

__all__ = ["ClusterDef", "JobDef", "ServerDef"]


@dataclass(frozen=True)
class JobDef:
    """One job: its name and ``{task_index: "host:port"}`` (tensorflow.JobDef)."""

    name: str
    tasks: dict[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ClusterDef:
    """The jobs of a cluster, in the order of the spec (tensorflow.ClusterDef)."""

    job: tuple[JobDef, ...] = ()

    def as_cluster_spec(self) -> ClusterSpec:
        """The `ClusterSpec` this definition describes."""
        from phalanx.cluster.cluster_spec import ClusterSpec

        return ClusterSpec({job.name: dict(job.tasks) for job in self.job})


@dataclass(frozen=True)
class ServerDef:
    """What a `phalanx.Server` serves (tensorflow.ServerDef)."""

    cluster: ClusterDef
    job_name: str
    task_index: int
    protocol: str = "grpc"
    port: int = 0
