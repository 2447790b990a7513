"""A MultiWorkerMirrored program inside Ray Train's TorchTrainer: it borrows Ray's group and
store, ends at one device's weights, and a worker SIGKILLed mid-run resumes through
BackupAndRestore after Ray's restart (``FailureConfig(max_failures=1)``). A parameter-server job
runs as Ray actors, one per task, each with a TF_CONFIG built from the actors' addresses.

One Ray cluster for the module (Ray takes tens of seconds to start): the script runs the
reference, the uninterrupted run, the killed run and the parameter-server job on it, and the
tests read what it wrote.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support.cluster import run_python

pytest.importorskip("ray.train.torch", reason="Ray Train is not installed (pip install 'ray[train]')")

# Ray's start, three runs and a restart: minutes on a loaded machine (the fixture runs in the first test)
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(1200)]

SCRIPT = Path(__file__).parent / "scripts" / "ray_train_fit.py"


@pytest.fixture(scope="module")
def ray_runs(tmp_path_factory):
    """The script's output and the directory where it left one_device.pt, ray.pt, ray_killed.pt."""
    work = tmp_path_factory.mktemp("ray")
    done = run_python(SCRIPT, work, timeout=1140, env={"RAY_USAGE_STATS_ENABLED": "0"})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    return done.stdout + done.stderr, work


def _assert_same_weights(got: Path, expected: Path) -> None:
    reference = torch.load(expected)
    weights = torch.load(got)
    for key, value in reference.items():
        torch.testing.assert_close(weights[key], value, rtol=1e-5, atol=1e-5, msg=key)


def test_a_program_in_torch_trainer_ends_at_one_devices_weights(ray_runs):
    output, work = ray_runs
    assert "ray: done" in output
    assert "ray worker 1: TorchrunClusterResolver" in output  # Ray's RANK/WORLD_SIZE/MASTER_*
    assert "cannot listen there" not in output  # no second store at Ray's MASTER_PORT
    _assert_same_weights(work / "ray.pt", work / "one_device.pt")


def test_a_worker_killed_in_torch_trainer_resumes_after_rays_restart(ray_runs):
    output, work = ray_runs
    assert (work / "killed-once").exists()  # the last worker was SIGKILLed mid-epoch
    assert "exited" in output  # the survivor's collective named its lost peer; Ray restarted both
    assert "ray_killed: done" in output
    _assert_same_weights(work / "ray_killed.pt", work / "one_device.pt")


def test_a_parameter_server_job_runs_as_ray_actors_with_tf_config(ray_runs):
    output, work = ray_runs
    assert "ps: done" in output
    chief = (work / "ps_chief.txt").read_text()
    assert "Epoch 2:" in chief
    accuracy = float(chief.split("final accuracy on all digits: ")[1].split()[0])
    assert accuracy > 0.6  # it trained (2 epochs of 40 steps); the launcher's test checks more
