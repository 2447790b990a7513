"""TF's ClusterDef and ServerDef messages, as plain dataclasses with the protos' field names.

``ClusterSpec.as_cluster_def()`` and ``Server.server_def`` return them. phalanx does not
depend on TensorFlow's protobufs; the field names (``job``, ``name``, ``tasks``,
``job_name``, ``task_index``, ``protocol``, ``port``) are TF's, so code that reads them
keeps working, and ``ClusterSpec(cluster_def)`` turns one back into a `ClusterSpec`, as in TF.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class ServerDef:
    """What a `phalanx.Server` serves (tensorflow.ServerDef)."""

    cluster: ClusterDef
    job_name: str
    task_index: int
    protocol: str = "grpc"
    port: int = 0
