"""Every cluster test starts from an environment without cluster variables, and leaves none."""

from __future__ import annotations

import os

import pytest

CLUSTER_VARS = (
    "TF_CONFIG",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


@pytest.fixture(autouse=True)
def clean_cluster_env(monkeypatch):
    """Removes TF_CONFIG, torchrun's and SLURM's variables for the test (monkeypatch restores them)."""
    for name in CLUSTER_VARS:
        monkeypatch.delenv(name, raising=False)
    for name in [n for n in os.environ if n.startswith(("SLURM_", "SLURMD_"))]:
        monkeypatch.delenv(name)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # SlurmClusterResolver(auto_set_gpu=True)
    return monkeypatch
