"""Every cluster test starts from an environment without cluster variables, and leaves none."""

from __future__ import annotations

import gc
import os
import threading
import time

import pytest

from phalanx import context

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


@pytest.fixture(autouse=True)
def _hygiene():
    """The shared hygiene (tests/conftest.py), minus its gc pass when nothing leaked.

    The shared fixture runs ``gc.collect()`` after every test (about 0.2 s with torch loaded)
    so that dropped strategies stop their replica threads. Cluster tests create no strategy,
    so garbage collection is needed only if a replica thread is found; the checks are the same.
    Launcher reader threads are checked too.
    """
    yield
    stack = list(context._state.stack)
    context._state.stack.clear()
    assert not stack, f"test left strategy scopes open: {stack}"
    deadline = time.monotonic() + 5
    while _leaked_threads() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert not _leaked_threads(), f"threads outlived their test: {_leaked_threads()}"


def _leaked_threads() -> list[str]:
    names = [t.name for t in threading.enumerate()]
    return [n for n in names if "-replica-" in n or n.startswith("phalanx-launch-")]
