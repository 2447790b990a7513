"""Cluster configuration: ClusterSpec, resolvers (TF_CONFIG, torchrun, SLURM) and validation."""

from phalanx.cluster.cluster_spec import ClusterSpec
from phalanx.cluster.launcher import launch, launch_node
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
    "launch_node",
    "resolve_cluster",
]
