"""resolve_cluster picks the resolver from the environment: TF_CONFIG, torchrun, SLURM, single."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from phalanx.cluster import (
    SimpleClusterResolver,
    SlurmClusterResolver,
    TFConfigClusterResolver,
    TorchrunClusterResolver,
    resolve_cluster,
)

TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1234"}
SLURM = {"SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "n1", "SLURM_NTASKS_PER_NODE": "1"}


def _set(env, values):
    for name, value in values.items():
        env.setenv(name, value)


def test_single_process_by_default():
    resolver = resolve_cluster()
    assert type(resolver) is SimpleClusterResolver
    assert (resolver.is_chief, resolver.world_size, resolver.rank) == (True, 1, 0)


def test_slurm_when_only_slurm_is_set(clean_cluster_env):
    _set(clean_cluster_env, SLURM)
    assert isinstance(resolve_cluster(), SlurmClusterResolver)


def test_torchrun_before_slurm(clean_cluster_env):
    _set(clean_cluster_env, {**SLURM, **TORCHRUN})
    assert isinstance(resolve_cluster(), TorchrunClusterResolver)


def test_tf_config_before_everything(clean_cluster_env):
    _set(clean_cluster_env, {**SLURM, **TORCHRUN})
    clean_cluster_env.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["a:1"]}}))
    assert isinstance(resolve_cluster(), TFConfigClusterResolver)
    clean_cluster_env.setenv("TF_CONFIG", "  ")  # blank: as if unset
    assert isinstance(resolve_cluster(), TorchrunClusterResolver)


def test_importing_reads_no_environment():
    code = (
        "import os; os.environ['TF_CONFIG'] = '{broken'; os.environ['RANK'] = 'x'; "
        "import phalanx.cluster, phalanx.cluster.launcher, phalanx.cluster.resolvers; print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "ok", done.stderr


TRAINJOB = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "h"}


def test_torchrun_arguments_without_torchrun_are_refused_naming_torchrun(clean_cluster_env):
    _set(clean_cluster_env, TRAINJOB)  # a Kubeflow TrainJob's node, the program started without torchrun
    with pytest.raises(ValueError, match=r"not\s+started by torchrun") as caught:
        resolve_cluster()
    assert "PET_NNODES=2" in str(caught.value)
    assert "torchrun prog.py" in str(caught.value)


def test_torchrun_arguments_under_torchrun_are_torchruns(clean_cluster_env):
    _set(clean_cluster_env, {**TRAINJOB, **TORCHRUN})  # torchrun read PET_* and set RANK...
    assert isinstance(resolve_cluster(), TorchrunClusterResolver)
