"""fit with BackupAndRestore, killed with SIGKILL mid-epoch, resumes to the uninterrupted result."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from support.cluster import run_cluster, run_python

pytestmark = pytest.mark.multiprocess

SCRIPT = Path(__file__).parent / "scripts" / "fit_with_backup.py"


def _run(tmp, name, save_freq, kill, strategy):
    out = tmp / f"{name}.pt"
    return run_python(SCRIPT, tmp / f"backup-{name}", out, save_freq, *kill, strategy, timeout=120), out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The weights of an uninterrupted fit under a strategy, run once per strategy for the module
    (saving backups changes nothing in training, so every save_freq resumes to the same weights)."""
    weights = {}

    def get(strategy):
        if strategy not in weights:
            done, out = _run(tmp_path_factory.mktemp("ref"), "ref", "epoch", ("-1", "-1"), strategy)
            assert done.returncode == 0, done.stderr
            weights[strategy] = torch.load(out)["weights"]
        return weights[strategy]

    return get


@pytest.mark.parametrize(
    ("save_freq", "strategy"),
    [("epoch", "one_device"), ("3", "one_device"), ("epoch", "mirrored_2cpu"), ("4", "mirrored_2cpu")],
)
def test_killed_fit_resumes_to_the_uninterrupted_weights(tmp_path, save_freq, strategy, uninterrupted):
    killed, out = _run(tmp_path, "run", save_freq, ("2", "4"), strategy)  # epoch 3 of 4, mid-epoch
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not out.exists()
    assert os.path.exists(tmp_path / "backup-run" / "backup.pt")
    resumed, out = _run(tmp_path, "run", save_freq, ("2", "4"), strategy)
    assert resumed.returncode == 0, resumed.stderr

    got = torch.load(out)
    for key, value in uninterrupted(strategy).items():
        torch.testing.assert_close(got["weights"][key], value, rtol=1e-6, atol=1e-7, msg=key)
    assert not (tmp_path / "backup-run").exists()  # deleted after a completed fit


def test_multi_worker_fit_killed_on_one_worker_resumes_exactly(tmp_path):
    def run(name, kill):
        target = tmp_path / name
        target.mkdir(exist_ok=True)
        args = [target / "backup", target / "final.pt", "epoch", *kill, "multi_worker"]
        return run_cluster(SCRIPT, *args, workers=2, timeout=120), target / "final.pt"

    run_ref, ref_out = run("ref", ("-1", "-1"))
    run_ref.check()
    killed, out = run("run", ("2", "4"))
    assert killed["worker-1"].returncode == -signal.SIGKILL, killed.output
    assert killed["worker-0"].returncode != 0, killed.output  # it lost its peer mid-step
    assert "PeerUnavailableError" in killed["worker-0"].output
    assert not out.exists()
    resumed, out = run("run", ("2", "4"))
    resumed.check()
    expected, got = torch.load(ref_out), torch.load(out)
    for key, value in expected["weights"].items():
        torch.testing.assert_close(got["weights"][key], value, rtol=1e-6, atol=1e-7, msg=key)
    assert not any(p.name.startswith("workertemp") for p in (tmp_path / "run").iterdir())
