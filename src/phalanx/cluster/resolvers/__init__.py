"""Cluster resolvers: where the tasks are and which one this process is.

``tf.distribute.cluster_resolver`` for phalanx: one resolver per source of configuration
(``TF_CONFIG``, torchrun's variables, SLURM, explicit values), over `ClusterResolver`.
Environment variables are read when a resolver is created, never at import.
"""

from __future__ import annotations

import os

from phalanx.cluster.resolvers.cluster_resolver import ClusterResolver
from phalanx.cluster.resolvers.kubernetes import KubernetesClusterResolver, KubernetesExecutableLocation
from phalanx.cluster.resolvers.simple import SimpleClusterResolver
from phalanx.cluster.resolvers.slurm import SlurmClusterResolver, expand_hostlist, expand_tasks_per_node
from phalanx.cluster.resolvers.tf_config import TFConfigClusterResolver
from phalanx.cluster.resolvers.torchrun import TorchrunClusterResolver, refuse_torchrun_arguments
from phalanx.cluster.resolvers.union import UnionResolver

__all__ = [
    "ClusterResolver",
    "KubernetesClusterResolver",
    "KubernetesExecutableLocation",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
    "TorchrunClusterResolver",
    "UnionResolver",
    "expand_hostlist",
    "expand_tasks_per_node",
    "resolve_cluster",
]


def resolve_cluster() -> ClusterResolver:
    """The resolver for this process's environment, read now.

    The first that applies: ``TF_CONFIG`` set (non-blank) → `TFConfigClusterResolver`;
    ``RANK`` and ``WORLD_SIZE`` set → `TorchrunClusterResolver`; ``SLURM_PROCID`` set →
    `SlurmClusterResolver`; else a single task (`SimpleClusterResolver` with no cluster,
    which is the chief of a world of one). torchrun's arguments as ``PET_*`` variables (Kubeflow
    TrainJob) without torchrun's ``RANK`` are an error, not a single task.

    Raises:
        ValueError: The chosen source is malformed (see each resolver), or ``PET_*`` variables
            are set but torchrun did not start this process.
    """
    env = os.environ
    if env.get("TF_CONFIG", "").strip():
        return TFConfigClusterResolver()
    if "RANK" in env and "WORLD_SIZE" in env:
        return TorchrunClusterResolver()
    refuse_torchrun_arguments(env)
    if "SLURM_PROCID" in env:
        return SlurmClusterResolver()
    return SimpleClusterResolver({})
