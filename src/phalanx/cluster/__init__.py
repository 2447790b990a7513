"""Cluster configuration and launching: ClusterSpec, resolvers, validation, the launcher.

``TF_CONFIG`` is the primary configuration (Kubernetes/Kubeflow TFJob set it); torchrun's
variables, SLURM's and explicit values work too. Nothing is read at import: resolvers read
the environment when created (`resolve_cluster()` picks one).
"""

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
