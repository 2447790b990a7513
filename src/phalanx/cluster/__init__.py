"""Cluster configuration: ClusterSpec, resolvers (TF_CONFIG, torchrun, SLURM) and validation."""

from phalanx.cluster.cluster_spec import ClusterSpec
from phalanx.cluster.launcher import launch
from phalanx.cluster.resolvers import (
    ClusterResolver,
    SimpleClusterResolver,
    SlurmClusterResolver,
    TFConfigClusterResolver,
    TorchrunClusterResolver,
    expand_hostlist,
    resolve_cluster,
)

__all__ = [
    "ClusterResolver",
    "ClusterSpec",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
    "TorchrunClusterResolver",
    "expand_hostlist",
    "launch",
    "resolve_cluster",
]
